"""`efdl run --prestart`: new rounds take pre-started workers (python/efdl/preload.py), a spare
serves one round only, and no spare or worker outlives a SIGKILLed agent.

Real etcd, real agents, real gloo workers (workers/allreduce_worker.py). Bounded in time; every
process started is killed by the fixture (by pid / process group).
"""

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
def job():
    c = cluster.Cluster(job="prestart-%d" % os.getpid())
    try:
        c.start_etcd()
        yield c
    finally:
        c.close()


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out after %ss waiting for %s" % (timeout, what))


def test_rounds_take_spares_and_none_outlives_a_killed_agent(job):
    a = job.start_agent("a", nnodes="1:2", extra=["--prestart"])
    job.wait_for_world(1, timeout=90)
    # Worker of round 1 plus, after the refill delay, the spare for the next round.
    two = wait_for(lambda: len(a.worker_pids()) == 2 and a.worker_pids(), 60,
                   "agent a's worker and its new spare")
    b = job.start_agent("b", nnodes="1:2", extra=["--prestart"])
    since = time.monotonic()
    job.wait_for_world(2, since=since, timeout=90)
    out = a.output()
    assert "pre-starting 1 python worker(s) (--prestart)" in out
    # The world-2 round of a ran on the spare that waited for it: one of the two earlier
    # children is still there; the other (round 1's worker) is gone for good.
    taken = [line for line in out.splitlines() if "taken from pre-started spares" in line]
    assert len(taken) >= 2 and "1 of 1 worker(s)" in taken[-1], out[-3000:]
    now = set(a.worker_pids())
    assert len(now & set(two)) == 1, (two, now)

    # SIGKILL of the agent alone: its worker and spare die with it (PR_SET_PDEATHSIG).
    children = wait_for(lambda: len(a.worker_pids()) == 2 and a.worker_pids(), 60,
                        "agent a's refilled spare")
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in children), 30,
             "agent a's children %s to die with it" % children)
    job.wait_for_world(1, since=time.monotonic(), agents=[b], timeout=90)


def test_prestart_rejects_a_command_that_is_not_python():
    proc = subprocess.run([cluster.efdl_bin(), "run", "--prestart", "--", "/bin/true"],
                          env=cluster.base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--prestart needs a worker command" in lines[0], proc.stderr


def test_a_new_node_joins_only_once_its_spare_has_imported(job, tmp_path):
    """While the newcomer's spare imports, the running node keeps training at world size 1; the
    newcomer joins (and the world grows) only after the spare reported its imports done."""
    gate = tmp_path / "go"
    (tmp_path / "gate.py").write_text(
        "import os, time\n"
        "t = time.monotonic() + 90\n"
        "while not os.path.exists(%r) and time.monotonic() < t:\n"
        "    time.sleep(0.05)\n" % str(gate))
    a = job.start_agent("a", nnodes="1:2")
    job.wait_for_world(1, timeout=90)
    env = {"PYTHONPATH": os.path.join(cluster.REPO, "python") + os.pathsep + str(tmp_path),
           "EFDL_PRELOAD_MODULES": "gate"}
    b = job.start_agent("b", nnodes="1:2", env=env, extra=["--prestart"])
    wait_for(lambda: "waiting for 1 pre-started worker(s) to import before joining" in b.output(),
             60, "agent b to wait for its spare")
    since = time.monotonic()
    # The job goes on without b meanwhile: a keeps running steps of its world-1 round.
    job.wait_for_world(1, since=since, agents=[a], timeout=60)
    assert " joined job " not in b.output(), b.output()[-3000:]
    assert job.world_sizes_since(since, agents=[a]) == {1}
    gate.write_text("1")
    job.wait_for_world(2, since=time.monotonic(), timeout=90)
    out = b.output()
    assert out.index("pre-started worker(s) imported after") < out.index(" joined job "), out
