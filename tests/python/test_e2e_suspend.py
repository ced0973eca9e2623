"""End-to-end suspend and resume (EFDL-SPEC section 4): a real etcd, real `efdl run` agents and
State workers on loopback; `efdl suspend` / `efdl resume` / `efdl status` as a user runs them.

Every process runs in its own session and is killed by process group when a test ends.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from cluster import PYTHON, REPO, base_env, efdl_bin, running, wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(efdl_bin() is None, reason="efdl binary not built (set EFDL_BIN)")

EXAMPLE = os.path.join(REPO, "examples", "suspend_resume.py")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "suspend_worker.py")
# The example's per-step line with --print-indices (after the agent's "[rank N] " prefix).
IDX_RE = re.compile(r"^\[rank \d+\] STEP round=\d+ rank=(\d+) world=(\d+) step=(\d+) epoch=(\d+) "
                    r"samples=(\d+) idx=([\d,]+)$")
DIGITS_TRAIN = 1438  # training samples of the digits split in examples/digits.py


@pytest.fixture
def cluster(tmp_path):
    with running("susp-%d-%d" % (os.getpid(), time.monotonic_ns() % 100000)) as c:
        env = {"EFDL_SHM_DIR": str(tmp_path / "shm")}
        os.makedirs(env["EFDL_SHM_DIR"])
        c.test_env = env
        yield c


def efdl(cluster, *argv, timeout=90):
    out = subprocess.run([efdl_bin(), *argv, "--etcd", cluster.endpoint, "--job", cluster.job],
                         env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=timeout)
    return out.returncode, out.stdout


def suspend(cluster):
    rc, out = efdl(cluster, "suspend", "--timeout", "60")
    assert rc == 0, out
    m = re.search(r"suspended at step (\d+)", out)
    return (int(m.group(1)) if m else None), out


def processes_of_job(job):
    """Pids of live processes whose environment has EFDL_JOB_ID=job (workers of the job)."""
    needle = ("EFDL_JOB_ID=%s" % job).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def example_steps(agent):
    """{(rank, epoch, step): (samples, [indices])} of the example's STEP lines."""
    out = {}
    for line in agent.output().splitlines():
        m = IDX_RE.match(line)
        if m:
            rank, _, step, epoch, samples = map(int, m.groups()[:5])
            out[(rank, epoch, step)] = (samples, [int(i) for i in m.group(6).split(",")])
    return out


def test_suspended_two_node_job_resumes_at_the_next_step_and_sample(cluster):
    cmd = [PYTHON, EXAMPLE, "--epochs", "1", "--print-indices", "--step-delay", "0.05"]
    agents = [cluster.start_agent(n, env=cluster.test_env, nnodes="2:2", command=cmd)
              for n in ("a", "b")]
    wait_for(lambda: any(s[4] >= 4 for a in agents for s in a.steps()), 120, "step 4")
    step, out = suspend(cluster)
    assert step is not None, out
    for a in agents:
        assert a.wait(30) == 0, a.output()[-3000:]
    assert "suspended at step %d" % step in agents[0].output() + agents[1].output()
    assert not processes_of_job(cluster.job), "workers still run after the suspend"
    before = {}
    for a in agents:
        before.update(example_steps(a))
    # Graceful: every rank stopped at the commit of step S (none ran past it).
    assert max(k[2] for k in before) == step, sorted(before)

    rc, out = efdl(cluster, "status", "--json")
    doc = json.loads(out[out.index("{"):])
    assert rc == 0 and doc["suspended"] and doc["suspended_step"] == step, out
    assert doc["phase"] == "suspended"
    # The example commits its epoch (a State keyword argument): the epoch of step S.
    epoch = [k[1] for k in before if k[2] == step][0]
    assert doc["suspended_epoch"] == epoch, out
    rc, out = efdl(cluster, "status")
    first = out.splitlines()[0]
    assert re.match(r"job %s: SUSPENDED after round \d+ at step %d \(epoch %d, snapshot \d+\); "
                    r"`efdl resume --job %s` continues it from there$"
                    % (cluster.job, step, epoch, cluster.job), first), out
    assert "world size 0" not in out and "master :0" not in out, out

    late = cluster.start_agent("c", env=cluster.test_env, nnodes="2:2", command=cmd)
    assert late.wait(30) != 0
    # The snapshot the job resumes from, named by step, epoch and commit sequence.
    assert re.search(r"job %s is suspended at step %d \(epoch %d, snapshot \d+\); run "
                     r"`efdl resume --job %s` to continue" % (cluster.job, step, epoch,
                                                              cluster.job),
                     late.output()), late.output()[-2000:]
    # Refused before it pre-started (and imported) any worker.
    assert "pre-starting" not in late.output(), late.output()[-2000:]

    rc, out = efdl(cluster, "resume")
    assert rc == 0 and "resumed" in out, out
    again = [cluster.start_agent(n, env=cluster.test_env, nnodes="2:2", command=cmd)
             for n in ("a", "b")]
    for a in again:
        assert a.wait(180) == 0, a.output()[-3000:]
    text = "\n".join(a.output() for a in again)
    # The resumed job's round has no coordinator: the first node says it took over that job,
    # not "took over coordination of job J from " with an empty name.
    assert "took over coordination of resumed job %s" % cluster.job in text, text[-3000:]
    assert not re.search(r"took over coordination of job \S+ from $", text, re.M), text[-3000:]
    m = re.search(r"RESUME epoch=0 step=(\d+) samples=(\d+) world=2", text)
    assert m, text[-3000:]
    assert int(m.group(1)) == step + 1
    assert int(m.group(2)) == before[(0, 0, step)][0]  # the sample count at step S
    after = {}
    for a in again:
        after.update(example_steps(a))
    assert min(k[2] for k in after) == step + 1
    # The epoch's data: steps 0..S before, S+1.. after, every sample exactly once.
    seen = [i for k, (_, idx) in before.items() if k[2] <= step for i in idx]
    seen += [i for _, idx in after.values() for i in idx]
    assert sorted(seen) == list(range(DIGITS_TRAIN))


def test_suspend_during_a_persist_records_the_newest_step(cluster):
    env = dict(cluster.test_env, EFDL_PERSIST_MIN_INTERVAL_MS="0", SUSPEND_WORKER_MB="64")
    a = cluster.start_agent("a", env=env, nnodes="1", command=[PYTHON, WORKER])
    wait_for(lambda: len(a.steps()) >= 3, 90, "three commits")
    step, out = suspend(cluster)
    assert a.wait(30) == 0, a.output()[-3000:]
    last = max(s[4] for s in a.steps())
    assert step == last, (step, last, out)  # the newest commit, not an older persisted one

    # Storage holds that step as its newest snapshot, and every checksum verifies.
    out = subprocess.run([efdl_bin(), "snapshots", "verify", "--job", cluster.job,
                          "--snapshot-dir", os.path.join(cluster.dir, "snapshots"), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert out.returncode == 0, out.stdout
    rows = json.loads(out.stdout)
    assert rows[0]["step"] == step and all(r["ok"] for r in rows), rows


def test_suspend_without_a_snapshot_still_stops_and_says_so(cluster):
    a = cluster.start_agent("a", env=cluster.test_env, nnodes="1",
                            command=["/bin/sleep", "600"])
    cluster.wait_joined(a)
    wait_for(lambda: a.worker_pids(), 30, "the worker")
    step, out = suspend(cluster)
    assert step is None and "no agent found a persisted snapshot" in out, out
    assert a.wait(30) == 0, a.output()[-3000:]
    assert "suspended; no snapshot of it" in a.output()
    rc, out = efdl(cluster, "status")
    assert rc == 0 and re.search(r"SUSPENDED after round \d+ \(no persisted step reported yet\)",
                                 out), out
    # Resuming twice is an error that says why.
    assert efdl(cluster, "resume")[0] == 0
    rc, out = efdl(cluster, "resume")
    assert rc == 1 and "is not suspended" in out, out


def test_suspend_and_resume_of_an_unknown_job_fail_clearly(cluster):
    for command in ("suspend", "resume"):
        rc, out = efdl(cluster, command)
        assert rc == 1 and "no job '%s' in etcd" % cluster.job in out, out
        assert len(out.strip().splitlines()) == 1, out


def test_example_suspend_resume_demo(tmp_path):
    env = base_env()
    env["EFDL_BIN"] = efdl_bin()
    env["EFDL_SHM_DIR"] = str(tmp_path)
    proc = subprocess.Popen([PYTHON, EXAMPLE, "--demo", "--suspend-after", "5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    m = re.search(r"demo: suspended at step (\d+), resumed at step (\d+)", out)
    assert m and int(m.group(2)) == int(m.group(1)) + 1, out[-3000:]
    assert "DONE test accuracy" in out
