"""Several `efdl run` agents sharing one real etcd on loopback, with workers doing real gloo
all-reduce (workers/allreduce_worker.py, an unmodified torch.distributed program).

Short settings keep it fast: --ttl 3, --last-call 1, --stop-grace 3, 0.1 s steps. Each test
kills every process it started (by pid / process group) when it ends.
"""

import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")


@pytest.fixture
def job(tmp_path):
    with cluster.running("e2e-%d" % os.getpid()) as c:
        yield c


def status(c):
    proc = subprocess.run([cluster.efdl_bin(), "status", "--etcd", c.endpoint, "--job", c.job,
                           "--json"], env=cluster.base_env(), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def max_step(agents, until):
    return max((s[4] for a in agents for s in a.steps() if s[0] <= until), default=-1)


def test_nodes_join_crash_and_leave_while_training_continues(job):
    env = {"WORKER_USE_CONTROL": "1", "WORKER_PROGRESS": os.path.join(job.dir, "progress")}
    a = job.start_agent("node-a", env=env)
    b = job.start_agent("node-b", env=env)
    c = job.start_agent("node-c", env=env)
    job.wait_for_world(3, timeout=90)

    st = status(job)
    assert st["world_size"] == 3, st
    assert sorted(m["id"] for m in st["members"]) == ["node-a", "node-b", "node-c"], st

    # A crash: the whole node (agent and workers) SIGKILLed at once.
    killed_at = time.monotonic()
    c.signal_group(signal.SIGKILL)
    resumed_at = job.wait_for_world(2, since=killed_at, agents=[a, b], timeout=60)
    print("SIGKILL -> first step at world 2: %.2f s" % (resumed_at - killed_at))
    # Generous for a loaded CI machine (a node's lease of --ttl expires, then one round forms;
    # bench/elastic measures the pause itself).
    assert resumed_at - killed_at < 45, "no step at world 2 within 45 s of the SIGKILL"
    # Training continued from where it was instead of starting over.
    after = [s[4] for x in (a, b) for s in x.steps(resumed_at)]
    assert min(after) >= max_step([a, b, c], killed_at) - 2

    # Scale out: a new node is taken in.
    joined_at = time.monotonic()
    d = job.start_agent("node-d", env=env)
    job.wait_for_world(3, since=joined_at, agents=[a, b, d], timeout=60)

    # At MAX (3), a newcomer waits as a standby...
    e = job.start_agent("node-e", env=env)
    cluster.wait_for(lambda: "standby" in e.output(), 30, "node-e to wait as a standby",
                     output=e.output, interval=0.1)
    assert not e.steps()

    # ...and is taken in when a member leaves gracefully (SIGTERM).
    left_at = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(30) == 128 + signal.SIGTERM
    assert "STOPPING" in a.output()          # its worker was asked over the control socket
    # The agent's last line says that the node left, on what, and with which exit code.
    last = a.output().rstrip().splitlines()[-1]
    assert last.endswith("node %s left job '%s' on SIGTERM; its workers are stopped; exit code "
                         "143" % (a.name, job.job)), last
    job.wait_for_world(3, since=left_at, agents=[b, d, e], timeout=60)

    # Graceful scale in below MAX: the others go on at world 2.
    left_at = time.monotonic()
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(30) == 128 + signal.SIGTERM
    resumed_at = job.wait_for_world(2, since=left_at, agents=[d, e], timeout=60)
    print("SIGTERM -> first step at world 2: %.2f s" % (resumed_at - left_at))


def test_heterogeneous_nodes_complete_and_late_agents_exit_zero(job):
    env = {"WORKER_STEPS": "15", "WORKER_STEP_TIME": "0.05",
           "WORKER_PROGRESS": os.path.join(job.dir, "progress")}
    a = job.start_agent("node-a", env=env, nnodes="2:2", nproc=1)
    job.wait_joined(a)   # two joins at the same instant can stall the rendezvous (reported)
    b = job.start_agent("node-b", env=env, nnodes="2:2", nproc=2)
    job.wait_for_world(3, timeout=90)
    assert a.wait(90) == 0, a.output()
    assert b.wait(30) == 0, b.output()
    ranks = {s[1] for x in (a, b) for s in x.steps()}
    assert ranks == {0, 1, 2}
    assert sorted({s[1] for s in b.steps()}) in ([0, 1], [1, 2])   # contiguous per node
    assert "DONE" in a.output() and "DONE" in b.output()
    late = job.start_agent("node-late", env=env, nnodes="2:2")
    assert late.wait(30) == 0, late.output()
    assert not late.steps()
    assert "already complete" in late.output(), late.output()
    # It learnt the job was complete before pre-starting (and importing) any worker.
    assert "pre-starting" not in late.output(), late.output()
    # `efdl status` says the job is complete instead of "world size 0, 0 node(s), master :0".
    proc = subprocess.run([cluster.efdl_bin(), "status", "--etcd", job.endpoint, "--job",
                           job.job], env=cluster.base_env(), capture_output=True, text=True,
                          timeout=30)
    first = proc.stdout.splitlines()[0]
    assert re.match(r"job %s: COMPLETE after round \d+ \(its workers finished\); `efdl reset "
                    r"--job %s` lets the job id run again$" % (job.job, job.job),
                    first), proc.stdout


def test_below_min_gives_up_after_join_timeout(job):
    a = job.start_agent("node-a", nnodes="2:3", extra=["--join-timeout", "3"])
    started = time.monotonic()
    code = a.wait(60)
    assert code != 0
    assert time.monotonic() - started < 40
    assert not a.steps()


def test_worker_failures_past_max_restarts_end_the_agent(job):
    env = {"WORKER_FAIL_RANK": "1", "WORKER_FAIL_STEP": "2", "WORKER_STEP_TIME": "0.05"}
    # The node left behind when the failing one gives up waits below MIN: keep that short.
    # Spawned workers: with the default pre-started ones node-b would join only after its
    # spare's `import torch`, which under load takes longer than node-a's 5 s join timeout.
    extra = ["--max-restarts", "1", "--join-timeout", "5", "--no-prestart"]
    a = job.start_agent("node-a", env=env, nnodes="2:2", extra=extra)
    job.wait_joined(a)
    b = job.start_agent("node-b", env=env, nnodes="2:2", extra=extra)
    codes = [a.wait(120), b.wait(60)]
    assert all(code not in (0, None) for code in codes), codes
    failing = [x for x in (a, b) if "rank 1 exited with status 3" in x.output()]
    assert failing, a.output()[-2000:] + b.output()[-2000:]
    assert any("giving up" in x.output() and "max-restarts 1" in x.output() for x in failing)


def test_frozen_node_is_fenced_and_rejoins_as_a_new_member(job):
    env = {"WORKER_USE_CONTROL": "1"}
    a = job.start_agent("node-a", env=env)
    b = job.start_agent("node-b", env=env)
    c = job.start_agent("node-c", env=env)
    job.wait_for_world(3, timeout=90)
    frozen_round = max(s[2] for s in c.steps())

    frozen_at = time.monotonic()
    c.signal_group(signal.SIGSTOP)
    resumed_at = job.wait_for_world(2, since=frozen_at, agents=[a, b], timeout=60)
    print("SIGSTOP -> first step at world 2: %.2f s" % (resumed_at - frozen_at))
    thawed_at = time.monotonic()
    c.signal_group(signal.SIGCONT)

    cluster.wait_for(lambda: "fenced" in c.output(), 30, "the thawed node to say it is fenced",
                     output=lambda: c.output()[-3000:], interval=0.1)
    # It never trains in its old round again, and comes back through a new one.
    job.wait_for_world(3, since=thawed_at, timeout=60)
    late_old = [s for s in c.steps(thawed_at + 1.0) if s[2] <= frozen_round]
    assert not late_old, late_old


# -- waits that say what they wait for, failures that reach every node (issue #22) -----------

def test_a_node_below_min_says_what_it_waits_for_every_15_s(job):
    a = job.start_agent("node-a", nnodes="2:3", extra=["--join-timeout", "17"])
    started = time.monotonic()
    code = a.wait(60)
    took = time.monotonic() - started
    out = a.output()
    assert code != 0
    assert "waiting for 1 more node(s): 1 of at least 2 registered; giving up in" in out, out
    assert "join timeout of 17 s" in out, out
    assert took < 45, took


# A program that fails on every rank at the same point: once the ranks of its round have met (as a
# program that fails right after init_process_group does), each exits 3. Without the meeting, the
# rank that starts a few ms later is stopped by its peer's failure before it fails on its own.
FAILS_AFTER_MEETING = """
import os, sys, time
where, rnd, world = sys.argv[1], os.environ["EFDL_ROUND"], int(os.environ["WORLD_SIZE"])
open(os.path.join(where, "%s-%s" % (rnd, os.environ["RANK"])), "w").close()
deadline = time.monotonic() + 20
while time.monotonic() < deadline and sum(
        name.startswith(rnd + "-") for name in os.listdir(where)) < world:
    time.sleep(0.001)
print("boom: the program cannot start", file=sys.stderr)
sys.exit(3)
"""


def test_a_node_that_gives_up_is_told_to_the_others_and_a_job_that_failed_everywhere_ends(
        job, tmp_path):
    """The program fails on every node. The node that spends its --max-restarts first records why
    in etcd; the other prints it at once and, its own workers having failed the same way and
    fewer than MIN nodes being left, ends too, long before its 300 s join timeout. A worker that
    failed on its own counts even when a peer's failure closed the round first (CI once saw
    node-a's workers stopped by node-b's failure every round, and node-a wait 300 s).
    `efdl status` shows the record."""
    command = [cluster.PYTHON, "-c", FAILS_AFTER_MEETING, str(tmp_path)]
    extra = ["--max-restarts", "1", "--join-timeout", "300", "--no-prestart"]
    a = job.start_agent("node-a", nnodes="2:2", extra=extra, command=command)
    b = job.start_agent("node-b", nnodes="2:2", extra=extra, command=command)
    started = time.monotonic()
    codes = [a.wait(120), b.wait(120)]
    took = time.monotonic() - started
    outs = a.output() + b.output()
    assert all(code not in (0, None) for code in codes), (codes, outs[-3000:])
    assert took < 90, (took, outs[-3000:])
    gave_up = [x for x in (a, b)
               if re.search(r"giving up: rank \d+ exited with status 3", x.output())]
    assert gave_up, outs[-3000:]
    others = [x for x in (a, b) if x not in gave_up]
    for other in others:
        out = other.output()
        assert re.search(r"node %s gave up: rank \d+ exited with status 3" % gave_up[0].name,
                         out), out
        assert "its last stderr line: boom: the program cannot start" in out, out
        assert "cannot go on" in out and "this node's workers failed too" in out, out
    proc = subprocess.run([cluster.efdl_bin(), "status", "--etcd", job.endpoint, "--job",
                           job.job], env=cluster.base_env(), capture_output=True, text=True,
                          timeout=30)
    assert "GAVE UP" in proc.stdout and "exited with status 3" in proc.stdout, proc.stdout
    assert "its last stderr lines:\n      boom: the program cannot start" in proc.stdout, (
        proc.stdout)
    st = status(job)
    assert gave_up[0].name in st["gave_up"], st
    assert st["gave_up"][gave_up[0].name]["stderr"] == ["boom: the program cannot start"], st


def test_a_second_program_under_a_running_jobs_id_is_refused_at_join(job, tmp_path):
    """Two different programs given one job id: the second agent is refused at once, in one
    line naming both programs, instead of becoming a standby of the first and exiting 0 when it
    completes without ever running."""
    first, second = tmp_path / "train_a.py", tmp_path / "train_b.py"
    first.write_text("import time\nprint('a runs', flush=True)\ntime.sleep(60)\n")
    second.write_text("print('b runs')\n")
    extra = ["--no-prestart"]
    a = job.start_agent("node-a", nnodes="1:2", extra=extra,
                        command=[cluster.PYTHON, str(first)])
    job.wait_joined(a)
    b = job.start_agent("node-b", nnodes="1:2", extra=extra,
                        command=[cluster.PYTHON, "-u", str(second)])
    assert b.wait(60) == 1, b.output()[-2000:]
    out = b.output()
    errors = [line for line in out.splitlines() if " E efdl: " in line]
    assert len(errors) == 1, out
    assert ("job '%s' runs train_a.py (node node-a), this node train_b.py" % job.job
            in errors[0]), out
    assert "its own --job" in errors[0], out
    assert "b runs" not in out
    assert a.proc.poll() is None, a.output()[-2000:]   # the first job runs on
    a.signal_group(signal.SIGTERM)
    a.wait(60)


def test_status_of_a_job_nobody_registered_is_one_line(job):
    proc = subprocess.run([cluster.efdl_bin(), "status", "--etcd", job.endpoint, "--job",
                           "nobody-here"], env=cluster.base_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no node has registered it" in lines[0], proc.stderr


def test_a_completed_job_id_used_again_says_so_and_efdl_reset_starts_it_over(job, tmp_path):
    """A job that completed: a late agent of it exits 0 but says on stderr that the job was
    already complete, when, and how to start it over; `efdl reset` refuses while an agent of
    the job runs, then removes the job from etcd and the next run runs the program again."""
    marker = "the program ran %d" % os.getpid()
    command = [cluster.PYTHON, "-c", "print(%r)" % marker]
    extra = ["--no-prestart"]
    first = job.start_agent("node-a", nnodes="1:1", extra=extra, command=command)
    assert first.wait(120) == 0, first.output()[-2000:]
    assert marker in first.output()
    late = job.start_agent("node-b", nnodes="1:1", extra=extra, command=command)
    assert late.wait(120) == 0, late.output()[-2000:]
    out = late.output()
    assert marker not in out, out
    assert re.search(r"job '%s' was already complete \(.*completed at 20\d\d-" % job.job, out), out
    assert "efdl reset --job %s" % job.job in out, out

    def reset():
        return subprocess.run([cluster.efdl_bin(), "reset", "--etcd", job.endpoint, "--job",
                               job.job, "--snapshot-dir", os.path.join(job.dir, "snapshots")],
                              env=cluster.base_env(), capture_output=True, text=True, timeout=60)
    done = reset()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "removed job '%s' from etcd" % job.job in done.stdout, done.stdout
    # An agent of the job (waiting for a second node) is running: reset refuses.
    busy = job.start_agent("node-c", nnodes="2:2", extra=extra,
                           command=[cluster.PYTHON, "-c", "print(1)"])
    job.wait_joined(busy)
    refused = reset()
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "is running: 1 agent(s) registered (node-c)" in refused.stderr, refused.stderr
    busy.kill()
    cluster.wait_for(lambda: reset().returncode == 0, 30, "reset once node-c's lease expired")
    again = job.start_agent("node-d", nnodes="1:1", extra=extra, command=command)
    assert again.wait(120) == 0, again.output()[-2000:]
    assert marker in again.output(), again.output()[-2000:]
