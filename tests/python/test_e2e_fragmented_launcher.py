"""End to end: fragmented jobs (`efdl run --world-size`) and a third-party launcher inside
`efdl run --launcher` (Debian's torchrun), each training the digits example with State and the
sampler, each with a node killed mid-run. They also run examples/fragmented.py and
examples/launcher_torchrun.sh so the examples never rot.

Every process is started in its own session and killed by process group if a test overruns; each
test checks that no process of its job (found by EFDL_JOB_ID in the environment, which torchrun's
workers inherit) is left running.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

REPO = cluster.REPO
PYTHON = cluster.PYTHON
EXAMPLES = os.path.join(REPO, "examples")
LAUNCHER_SH = os.path.join(EXAMPLES, "launcher_torchrun.sh")

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

RESUME_RE = re.compile(r"\[rank 0\] resuming at epoch (\d+), sample (\d+) of the epoch, (\d+) "
                       r"samples in all, world (\d+), round (\d+)")
DONE_RE = re.compile(r"\[rank 0\] training complete: (\d+) samples")


def job_processes(job, round_=None):
    """(pid, cmdline) of live processes whose environment names `job` (and `round_`)."""
    want = [b"EFDL_JOB_ID=" + job.encode()]
    if round_ is not None:
        want.append(b"EFDL_ROUND=%d" % round_)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as f:
                env = f.read().split(b"\0")
            with open("/proc/%s/stat" % entry) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and all(w in env for w in want):
            found.append((int(entry), cmd))
    return found


def test_fragmented_example_replaces_the_two_process_node_by_two_one_process_nodes(tmp_path):
    # examples/fragmented.py: 1 + 2 processes (world 3), then the 2-process node is SIGKILLed
    # after two 1-process nodes joined as standbys; the job goes on as 1 + 1 + 1 and finishes.
    env = cluster.base_env()
    env["EFDL_BIN"] = cluster.efdl_bin()
    env["TMPDIR"] = str(tmp_path)   # torchrun leaves its log directory (torchelastic_*) behind
    proc = subprocess.Popen([PYTHON, os.path.join(EXAMPLES, "fragmented.py"), "--replace",
                             "--epochs", "1", "--steps-before-replace", "4", "--timeout", "100",
                             # 1 s steps: the epoch must outlast node-c and then node-d each
                             # importing torch into its pre-started worker before it joins.
                             "--step-delay", "1.0"],
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=170)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError("fragmented.py ran over 170 s:\n" + out[-6000:])
    assert proc.returncode == 0, out[-6000:]
    job = re.search(r"\(job (fragmented-\S+)\)", out).group(1)

    # Round 1: node-a rank 0, node-b ranks 1..2 of world 3 (a 1 + 2 round, not 1 + 1).
    first = re.search(r"node-a .*round (\d+): node rank 0 of 2, ranks 0\.\.0 of world 3", out)
    assert first, out[-6000:]
    r1 = int(first.group(1))
    assert re.search(r"node-b .*round %d: node rank 1 of 2, ranks 1\.\.2 of world 3" % r1, out)
    # The standbys waited without disturbing round 1 ...
    for node in ("node-c", "node-d"):
        assert re.search(r"%s .*round %d: standby \(the members' processes already add up to "
                         r"world size 3\)" % (node, r1), out), out[-6000:]
    # ... then took node-b's place: 1 + 1 + 1 with node-a still rank 0.
    second = re.search(r"node-a .*round (\d+): node rank 0 of 3, ranks 0\.\.0 of world 3", out)
    assert second and int(second.group(1)) > r1, out[-6000:]
    r2 = int(second.group(1))
    # The two newcomers follow in join order (they start together, either may be first).
    ranks = {re.search(r"%s .*round %d: node rank (\d) of 3, ranks (\d)\.\.(\d) of world 3"
                       % (node, r2), out).groups() for node in ("node-c", "node-d")}
    assert ranks == {("1", "1", "1"), ("2", "2", "2")}, ranks

    resumes = [tuple(map(int, m)) for m in RESUME_RE.findall(out)]
    assert resumes[0][2] == 0 and resumes[0][3] == 3, resumes
    later = [r for r in resumes if r[4] > r1]
    assert later and later[-1][3] == 3, resumes
    assert later[-1][2] > 0, "round %d restarted from scratch: %s" % (r2, resumes)
    # Steps continued: the last round trained past the point it resumed at, to the end.
    done = int(DONE_RE.search(out).group(1))
    assert 1438 <= done <= 1438 + 3, done
    assert "fragmented job complete" in out
    assert not job_processes(job), job_processes(job)


@pytest.fixture
def torchrun_job(tmp_path):
    with cluster.running("tr-%d-%d" % (os.getpid(), int(time.time()))) as c:
        yield c


def test_torchrun_inside_efdl_run_launcher_survives_a_node_kill(torchrun_job):
    # 2 EFDL nodes, each `efdl run --launcher --nproc-per-node 2 -- launcher_torchrun.sh`: one
    # torchrun per node with 2 workers (world 4). The node of ranks 2..3 is SIGKILLed (agent,
    # torchrun and its workers) and replaced by node-c; the job resumes at world 4 and finishes.
    c = torchrun_job
    shm = os.path.join(c.dir, "shm")
    os.makedirs(shm)
    # Debian's torchrun, through the one-line Python 3.11 fix the script picks by default.
    # TMPDIR: torchrun leaves its log directory (torchelastic_*) behind; keep it in the job's.
    env = {"EFDL_SHM_DIR": shm, "TMPDIR": c.dir}
    train = [LAUNCHER_SH, "--epochs", "1", "--batch-size", "16", "--commit-interval", "3",
             "--log-interval", "1", "--step-delay", "0.1"]
    kw = dict(env=env, nnodes="2", nproc=2, extra=["--launcher", "--max-restarts", "5"],
              command=train)
    c.start_agent("node-a", **kw)
    c.start_agent("node-b", **kw)
    outputs = lambda: "\n----\n".join(x.name + ":\n" + x.output()[-3000:] for x in c.agents)  # noqa: E731

    def resumes(agent):
        return [tuple(map(int, m)) for m in RESUME_RE.findall(agent.output())]

    def lead():
        """The agent whose launcher runs global rank 0 (its output has rank 0's lines)."""
        return next((x for x in c.agents if resumes(x)), None)

    def steps_at_world_4(agent):
        return re.findall(r"^\[rank 0\] epoch 0 step \d+ samples \d+ loss \S+ world 4 ",
                          agent.output(), re.M)

    cluster.wait_for(lambda: lead() and len(steps_at_world_4(lead())) >= 3, 150,
                     "round 1 to train at world 4", outputs)
    a = lead()
    b = next(x for x in c.agents if x is not a)
    r1 = resumes(a)[0][4]
    placed = re.search(r"round %d: node rank 1 of 2, ranks 2\.\.3 of world 4, master "
                       r"127\.0\.0\.1:\d+ \(one launcher process for them\)" % r1, b.output())
    assert placed, outputs()
    # One torchrun per node, each with two workers in its process group.
    assert len(job_processes(c.job, r1)) >= 2 * (1 + 2), job_processes(c.job, r1)

    b.kill()
    c3 = c.start_agent("node-c", **kw)
    cluster.wait_for(lambda: [r for r in resumes(a) if r[4] > r1 and r[3] == 4], 150,
                     "a new round to resume at world 4", outputs)
    # The survivor's round-1 torchrun was stopped with all its workers (its whole process group).
    cluster.wait_for(lambda: not job_processes(c.job, r1), 20,
                     "round-%d processes to be gone" % r1, lambda: str(job_processes(c.job, r1)))
    assert a.wait(150) == 0, outputs()
    assert c3.wait(60) == 0, outputs()
    later = [r for r in resumes(a) if r[4] > r1]
    assert later[-1][2] > 0, resumes(a)   # resumed from a commit, not from scratch
    done = DONE_RE.search(a.output())
    assert done and int(done.group(1)) >= 1438, outputs()
    assert re.search(r"round \d+: node rank 1 of 2, ranks 2\.\.3 of world 4", c3.output())
    assert not job_processes(c.job), job_processes(c.job)
