"""Suspend a training job and resume it later (EFDL-SPEC section 4): State + DistributedSampler.

One command shows it all (a private etcd, the job, `efdl suspend` mid-epoch, a refused start,
`efdl resume`, the job continuing at the next step and finishing):
    /usr/bin/python3 examples/suspend_resume.py --demo
By hand, with an etcd running (`efdl etcd`):
    efdl run --etcd 127.0.0.1:2379 --job digits-s -- /usr/bin/python3 examples/suspend_resume.py
    efdl suspend --etcd 127.0.0.1:2379 --job digits-s   # waits; prints "suspended at step S"
    efdl resume --etcd 127.0.0.1:2379 --job digits-s
    efdl run ... (the same command again)                # continues with step S+1

The training program itself has nothing suspend-specific: the agent asks its workers to stop,
State.commit() then snapshots, persists and exits 0, and the next start restores the snapshot;
the sampler resumes at the exact sample position. A suspended job is an elastic job with
min = max nodes (here 1 node, --nproc-per-node 1); any size works the same way.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3"


def train(args):
    import torch
    import torch.nn.functional as F
    from torch import optim
    from torch.utils.data import DataLoader, Dataset

    sys.path.insert(0, HERE)
    import efdl.backend.torch as efdl
    from digits import DigitsCNN, accuracy, load_digits_datasets

    class Indexed(Dataset):
        """(x, y, index): the index lets --print-indices show the exact data position."""

        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            return x, y, i

    efdl.init()
    torch.manual_seed(0)
    train_set, test_set = load_digits_datasets()
    world, rank = efdl.get_world_size(), efdl.get_rank()
    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = efdl.State(model, optimizer, epoch=0, step=-1, samples=0)
    state.set_commit_interval(args.commit_interval)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    start = efdl.exact_resume(state.samples, args.batch_size, world)
    sampler = efdl.data.DistributedSampler(Indexed(train_set), epoch=state.epoch,
                                           global_start_index=start.global_start_index)
    loader = DataLoader(Indexed(train_set), batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print("RESUME epoch=%d step=%d samples=%d world=%d" % (state.epoch, start.step,
                                                               state.samples, world), flush=True)
    for epoch in range(state.epoch, args.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        for state.step, (data, target, index) in enumerate(loader, start=start.step):
            optimizer.zero_grad()
            F.cross_entropy(ddp(data), target).backward()
            optimizer.step()
            state.samples += len(data) * world
            if args.print_indices or (rank == 0 and state.step % args.log_interval == 0):
                print("STEP round=%s rank=%d world=%d step=%d epoch=%d samples=%d%s" % (
                    os.environ.get("EFDL_ROUND", "0"), rank, world, state.step, epoch,
                    state.samples, " idx=" + ",".join(map(str, index.tolist()))
                    if args.print_indices else ""), flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
            state.commit()  # a suspend stops the worker here, after the snapshot is persisted
        state.epoch, state.step, state.samples = epoch + 1, -1, 0
        start = efdl.exact_resume(0, args.batch_size, world)
        state.commit()
    if rank == 0:
        print("DONE test accuracy %.4f" % accuracy(model, test_set), flush=True)


class Proc:
    """A child in its own session whose output lines are collected (and echoed) as they come."""

    def __init__(self, name, argv, env):
        self.name, self.lines = name, []
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))
            print("[%s] %s" % (self.name, line.rstrip("\n")), flush=True)

    def wait_line(self, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.p.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise SystemExit("demo: %s printed no line matching %r" % (self.name, pattern))

    def wait(self, timeout):
        rc = self.p.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return rc

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, 9)
            self.p.wait()


def demo(args):
    efdl_bin = os.environ.get("EFDL_BIN") or shutil.which("efdl") or os.path.join(
        os.path.dirname(HERE), "build", "efdl")
    tmp = tempfile.mkdtemp(prefix="efdl-suspend-demo-")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(HERE), "python"),
               OMP_NUM_THREADS="1")
    job = "suspend-demo-%d" % os.getpid()
    procs = []

    def start(name, argv):
        procs.append(Proc(name, argv, env))
        return procs[-1]

    def efdl(*argv, timeout=120):
        out = subprocess.run([efdl_bin, *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout)
        for line in out.stdout.splitlines():
            print("[efdl %s] %s" % (argv[0], line), flush=True)
        return out

    try:
        etcd = start("etcd", [efdl_bin, "etcd", "--port", "0", "--data-dir", tmp + "/etcd"])
        endpoint = etcd.wait_line(r"^EFDL_ETCD_ENDPOINTS=(\S+)", 60).group(1)
        run = [efdl_bin, "run", "--etcd", endpoint, "--job", job, "--snapshot-dir",
               tmp + "/snapshots", "--stop-grace", "10", "--", PYTHON, os.path.abspath(__file__),
               "--epochs", "1", "--log-interval", "1", "--step-delay", str(args.step_delay)]
        first = start("run-1", run)
        first.wait_line(r"^\[rank 0\] STEP .* step=%d " % args.suspend_after, 180)
        suspend = efdl("suspend", "--etcd", endpoint, "--job", job)
        m = re.search(r"suspended at step (\d+)", suspend.stdout)
        if suspend.returncode != 0 or not m or first.wait(60) != 0:
            raise SystemExit("demo: the suspend failed")
        step = int(m.group(1))
        refused = start("run-refused", run)  # a suspended job refuses new agents
        if refused.wait(60) == 0 or not any("is suspended at step" in l for l in refused.lines):
            raise SystemExit("demo: an agent started while the job was suspended was not refused")
        efdl("resume", "--etcd", endpoint, "--job", job)
        second = start("run-2", run)
        resumed = int(second.wait_line(r"RESUME epoch=\d+ step=(\d+)", 180).group(1))
        rc = second.wait(600)
        print("demo: suspended at step %d, resumed at step %d, second run exited %d"
              % (step, resumed, rc), flush=True)
        return 0 if rc == 0 and resumed == step + 1 else 1
    finally:
        for p in reversed(procs):
            p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="run the whole suspend/resume story")
    p.add_argument("--suspend-after", type=int, default=15, help="--demo: suspend after this step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--commit-interval", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.05, help="seconds of sleep per step")
    p.add_argument("--print-indices", action="store_true",
                   help="every rank prints every step with its sample indices (tests)")
    args = p.parse_args()
    return demo(args) if args.demo else train(args)


if __name__ == "__main__":
    sys.exit(main())
