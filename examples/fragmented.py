"""A fragmented job (EFDL-SPEC section 5): one 3-process job placed as 1 + 2 processes on two nodes.

Run (one command; a private etcd and the nodes run on this machine, on loopback):
    /usr/bin/python3 examples/fragmented.py              # 1 + 2 processes train to the end
    /usr/bin/python3 examples/fragmented.py --replace    # ... and the 2-process node is replaced
                                                         # by two 1-process nodes mid-run

What it starts is what you would run on two hosts with 1 and 2 free GPUs (`efdl plan --procs 3
--free hostA:1,hostB:2` says where), after `efdl etcd` once:
    hostA$ efdl run --etcd ETCD:2379 --job frag --world-size 3 --nproc-per-node 1 -- \\
               /usr/bin/python3 examples/train_ddp_state.py
    hostB$ efdl run --etcd ETCD:2379 --job frag --world-size 3 --nproc-per-node 2 -- \\
               /usr/bin/python3 examples/train_ddp_state.py
A round forms only when the members' processes add up to exactly 3; ranks are contiguous per node
(hostA rank 0, hostB ranks 1-2). The training program is train_ddp_state.py unchanged: it calls
efdl.init() instead of init_process_group, runs as plain python3 (no torch.distributed.launch),
and takes its local rank from efdl.get_local_rank().

--replace: once training runs, two 1-process nodes join; the round already adds up, so they wait as
standbys (the running round is not disturbed). Then the 2-process node is killed without warning:
the survivor and the two standbys form a 1 + 1 + 1 round (the survivor keeps rank 0) that resumes
from the last commit and trains to the end.
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import DemoError  # noqa: E402
from local_job import PYTHON, run_example  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESUME = r"^\[rank 0\] resuming at epoch \d+, sample \d+ of the epoch, (\d+) samples in all, " \
         r"world (\d+), round (\d+)"
STEP = r"^\[rank 0\] epoch \d+ step \d+ samples \d+ loss [\d.]+ world 3"
DONE = r"^\[rank 0\] training complete: (\d+) samples"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replace", action="store_true",
                   help="replace the 2-process node by two 1-process nodes mid-run")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-delay", type=float, default=0.05,
                   help="seconds per training step, so the tiny job lasts long enough to watch")
    p.add_argument("--steps-before-replace", type=int, default=6)
    p.add_argument("--timeout", type=float, default=180, help="bound on each wait, in seconds")
    args = p.parse_args(argv)
    train = [PYTHON, os.path.join(HERE, "train_ddp_state.py"), "--epochs", str(args.epochs),
             "--batch-size", "16", "--commit-interval", "5", "--log-interval", "1",
             "--step-delay", str(args.step_delay)]

    def node_args(nproc):
        return ["--world-size", "3", "--nproc-per-node", str(nproc), "--ttl", "3",
                "--last-call", "1", "--stop-grace", "5"]

    def body(job):
        # One after the other, so join order (and with it the ranks) is the same in every run.
        job.start_node("node-a", node_args(1), train)
        job.wait_for("node-a to join", lambda: job.count(" joined job ", ("node-a",)), 60)
        job.start_node("node-b", node_args(2), train)
        resumed = job.wait_for("the 1 + 2 round to train", lambda: (
            len(job.count(STEP)) >= args.steps_before_replace and job.count(RESUME)), args.timeout)
        first_round = int(re.match(RESUME, resumed[0][1]).group(3))
        job.say("round %d trains at world 3: node-a 1 process + node-b 2 processes"
                % first_round)
        if args.replace:
            mark = job.mark()
            job.start_node("node-c", node_args(1), train)
            job.wait_for("node-c to join", lambda: job.count(" joined job ", ("node-c",), mark),
                         60)
            job.start_node("node-d", node_args(1), train)
            job.wait_for("node-c and node-d to wait as standbys", lambda: all(
                job.count(r": standby", (n,), mark) for n in ("node-c", "node-d")), args.timeout)
            mark = job.mark()
            job.kill_node("node-b")
            job.wait_for("a 1 + 1 + 1 round to resume training", lambda: job.count(
                r"^\[rank 0\] resuming at .* world 3, round (?!%d\b)" % first_round,
                ("node-a",), mark), args.timeout)
        done = job.wait_for("training to complete", lambda: job.count(DONE), args.timeout)
        killed = {"node-b"} if args.replace else set()
        codes = {n: job.wait_exit(n, args.timeout) for n in job.procs
                 if n != "etcd" and n not in killed}
        job.say("exit codes: %s" % ", ".join("%s %d" % kv for kv in sorted(codes.items())))
        if any(codes.values()):
            raise DemoError("a node exited non-zero: %s" % codes)
        job.say("fragmented job complete: %s samples trained"
                % re.match(DONE, done[0][1]).group(1))

    return run_example("fragmented", body)


if __name__ == "__main__":
    sys.exit(main())
