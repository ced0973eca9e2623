"""Programs written for torchrun and Horovod, unchanged, under real `efdl run` agents on one etcd
(#34). Short settings as in test_e2e_elastic.py (--ttl 3, --last-call 1, --stop-grace 3).

- An elastic Horovod program with `import horovod.torch as hvd` (workers/horovod_style_elastic.py)
  under `efdl run --horovod`, through a SIGKILL, a join and a graceful leave: it trains on EFDL's
  Horovod layer, the survivors keep their processes, and its torch DistributedSampler, built
  before hvd.elastic.run, is said to be stale once per surviving process after the shrink; the
  same program building its sampler in the function is not warned about.
- A torchrun-style program that resumes from its own checkpoint only with --resume
  (workers/own_checkpoint_worker.py) under `efdl run --resume-args --resume`: its steps continue
  across a SIGKILL and a join, the first round starts without the flag, and every resumed
  round's workers are pre-started ones.
- The torchrun script of docs/integrations.md, as written there, under `efdl run --launcher` on
  this machine's Debian 12 torchrun (Python 3.11).
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

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
HOROVOD_PROGRAM = os.path.join(WORKERS, "horovod_style_elastic.py")
OWN_CKPT_PROGRAM = os.path.join(WORKERS, "own_checkpoint_worker.py")
HSTEP_RE = re.compile(r"^\[rank \d+\] HSTEP round=(\d+) rank=(\d+) size=(\d+) epoch=(\d+) "
                      r"batch=(\d+) pid=(\d+) params=(\S+) replicas=(\d+)")
STALE = "still has num_replicas="
START_RE = re.compile(r"^\[rank \d+\] START rank=(\d+) step=(\d+) resume=(\d)")
SPARES_RE = re.compile(r"round (\d+): (\d+) of (\d+) worker\(s\) taken from pre-started spares")


@pytest.fixture
def job():
    with cluster.running("e2e-integ-%d" % os.getpid()) as c:
        yield c


def hsteps_of(agent, since=0.0):
    """(time, round, rank, size, epoch, batch, pid, params, replicas) of each HSTEP line."""
    out = []
    for t, text in list(agent.lines):
        m = HSTEP_RE.match(text)
        if m and t >= since:
            g = m.groups()
            out.append((t, int(g[0]), int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5]),
                        float(g[6]), int(g[7])))
    return out


def wait_size(agents, size, since, timeout=90):
    """Waits until every rank of a round of `size` ranks trained a batch after `since`."""
    def seen():
        by_round = {}
        for a in agents:
            for s in hsteps_of(a, since):
                if s[3] == size:
                    by_round.setdefault(s[1], set()).add(s[2])
        return any(len(r) == size for r in by_round.values())
    cluster.wait_for(seen, timeout, "a round of size %d; outputs:\n%s" % (
        size, "\n----\n".join(a.name + ":\n" + a.output()[-2500:] for a in agents)))


def test_an_unmodified_horovod_program_runs_under_efdl_run_horovod(job):
    command = [cluster.PYTHON, HOROVOD_PROGRAM, "--epochs", "100000", "--step-time", "0.05"]
    a, b, c = (job.start_agent(n, command=command, extra=["--horovod"])
               for n in ("node-a", "node-b", "node-c"))
    wait_size([a, b, c], 3, 0)
    killed = time.monotonic()
    c.signal_group(signal.SIGKILL)                   # a crash of a whole node
    wait_size([a, b], 2, killed)
    # The shrink leaves the program's sampler at 3 replicas: said at its next iteration.
    cluster.wait_for(lambda: STALE in a.output() and STALE in b.output(), 60,
                     "the stale-sampler warning; outputs:\n%s\n----\n%s" % (
                         a.output()[-3000:], b.output()[-3000:]))
    joined = time.monotonic()
    d = job.start_agent("node-d", command=command, extra=["--horovod"])   # a join
    wait_size([a, b, d], 3, joined)
    left = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)               # a graceful leave
    wait_size([a, b], 2, left)
    assert d.wait(30) == 128 + signal.SIGTERM
    cluster.wait_for(lambda: len([s for s in hsteps_of(a, left) if s[3] == 2]) >= 5, 60,
                     "steps after the leave")

    for agent in (a, b):
        out = agent.output()
        assert "ImportError" not in out and "Traceback" not in out, out[-3000:]
        steps = hsteps_of(agent)
        # Rounds of 3, 2 (the crash), 3 (the join) and 2 (the leave), in the same process.
        sizes = [s[3] for s in steps]
        changes = [y for x, y in zip([None] + sizes, sizes) if x != y]
        assert changes == [3, 2, 3, 2], (agent.name, sorted({(s[1], s[3]) for s in steps}))
        assert len({s[6] for s in steps}) == 1, (agent.name, {s[6] for s in steps})
        assert "continue in-process" in a.output() or "continue in-process" in b.output()
        # Said once per process, with the fix, although the sampler stayed stale for every
        # later epoch at size 2.
        warnings = [line for line in out.splitlines() if STALE in line]
        assert len(warnings) == 1, (agent.name, warnings)
        assert "num_replicas=3, but the job now has 2 ranks" in warnings[0], warnings
        assert "inside the @efdl.elastic.run (@hvd.elastic.run) function" in warnings[0]
        assert "efdl.data.DistributedSampler" in warnings[0]
    # The sampler built before the rounds kept its 3 replicas (what the warning is about).
    assert {s[8] for s in hsteps_of(a) if s[3] == 2} == {3}
    # Every rank of a round holds the same parameters after each batch.
    by_batch = {}
    for agent in (a, b, c, d):
        for s in hsteps_of(agent):
            by_batch.setdefault((s[1], s[4], s[5]), set()).add(s[7])
    assert not {k: v for k, v in by_batch.items() if len(v) > 1}


def test_a_sampler_built_in_the_function_is_not_warned_about(job):
    command = [cluster.PYTHON, HOROVOD_PROGRAM, "--epochs", "100000", "--step-time", "0.05",
               "--sampler-per-round"]
    a = job.start_agent("node-a", command=command, extra=["--horovod"], nnodes="1:2")
    b = job.start_agent("node-b", command=command, extra=["--horovod"], nnodes="1:2")
    wait_size([a, b], 2, 0)
    killed = time.monotonic()
    b.signal_group(signal.SIGKILL)
    wait_size([a], 1, killed)
    # A few epochs at size 1 (12 batches each at 32 samples per rank... 384/8): well past the
    # first iteration of any sampler of the last round.
    cluster.wait_for(lambda: len({s[4] for s in hsteps_of(a, killed) if s[3] == 1}) >= 3, 90,
                     "three epochs at size 1; output:\n" + a.output()[-3000:])
    out = a.output()
    assert STALE not in out, out[-3000:]
    assert {s[8] for s in hsteps_of(a, killed) if s[3] == 1} == {1}
    assert len({s[6] for s in hsteps_of(a)}) == 1   # in-process, the same worker


def starts_of(agent):
    """(round, rank, step, resume) of each START line, the round from the agent's line before."""
    out, round_ = [], None
    for _, text in list(agent.lines):
        m = re.search(r"round (\d+): node rank", text)
        if m:
            round_ = int(m.group(1))
        m = START_RE.match(text)
        if m:
            out.append((round_, int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return out


def test_resume_args_continue_a_programs_own_checkpoint_with_prestarted_workers(job):
    ckpt = os.path.join(job.dir, "ckpt.pt")
    command = [cluster.PYTHON, OWN_CKPT_PROGRAM, "--ckpt", ckpt, "--steps", "100000"]
    env = {"WORKER_STEP_TIME": "0.1"}
    extra = ["--resume-args", "--resume"]
    a, b, c = (job.start_agent(n, command=command, extra=extra, env=env)
               for n in ("node-a", "node-b", "node-c"))
    job.wait_for_world(3, timeout=120)
    cluster.wait_for(lambda: max([s[4] for s in a.steps()] or [0]) >= 5, 60, "5 steps")
    killed = time.monotonic()
    c.signal_group(signal.SIGKILL)                   # a crash of a whole node
    job.wait_for_world(2, since=killed, agents=[a, b], timeout=90)
    cluster.wait_for(lambda: len(a.steps(killed)) >= 3, 60, "steps after the crash")
    joined = time.monotonic()
    d = job.start_agent("node-d", command=command, extra=extra, env=env)   # a join
    job.wait_for_world(3, since=joined, agents=[a, b, d], timeout=120)
    cluster.wait_for(lambda: len(d.steps(joined)) >= 3, 60, "steps after the join")

    # Round 1 started fresh; every later start resumed from the checkpoint.
    starts = starts_of(a) + starts_of(b) + starts_of(d)
    first_round = min(r for r, _, _, _ in starts)
    assert {(s, r) for rnd, _, s, r in starts if rnd == first_round} == {(0, 0)}, starts
    later = [s for s in starts if s[0] != first_round]
    assert len({s[0] for s in later}) >= 2 and all(s[3] == 1 for s in later), starts
    # Steps continue: each round starts where the checkpoint was, never back at 0, and at or
    # after the last step rank 0 had finished (it saves before it prints).
    for agent in (a, b, d):
        for rnd in sorted({s[0] for s in starts_of(agent)} - {first_round}):
            start = [s[2] for s in starts_of(agent) if s[0] == rnd]
            before = [s[4] for x in (a, b, c, d) for s in x.steps()
                      if s[2] < rnd and s[1] == 0]
            assert start and start[0] >= max(before) > 0, (agent.name, rnd, start,
                                                           max(before or [0]))
    # The resumed rounds' workers were the pre-started ones, given the flag.
    for agent in (a, b, d):
        out = agent.output()
        spares = {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
                  for m in SPARES_RE.finditer(out)}
        resumed = [r for r in spares if r != first_round]
        assert resumed and all(spares[r] == (1, 1) for r in resumed), (agent.name, spares)
        assert "the command gets --resume-args --resume" in out, out[-3000:]


DOC_TRAIN = """\
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print("TRAINED rank=%d world=%d sum=%d args=%s" % (dist.get_rank(), dist.get_world_size(),
                                                   int(t.item()), " ".join(sys.argv[1:])),
      flush=True)
"""


def test_the_documented_torchrun_script_runs_as_written(tmp_path):
    doc = open(os.path.join(cluster.REPO, "docs", "integrations.md")).read()
    marker = "<!-- launch.sh: tests/python/test_e2e_integrations.py runs this block as written -->"
    block = doc.split(marker, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    assert "exec torchrun" in block, block
    (tmp_path / "launch.sh").write_text(block)
    (tmp_path / "launch.sh").chmod(0o755)
    (tmp_path / "train.py").write_text(DOC_TRAIN)
    env = cluster.base_env()
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run([cluster.efdl_bin(), "run", "--launcher", "--nproc-per-node", "2",
                           "--snapshot-dir", str(tmp_path / "snapshots"), "--",
                           "./launch.sh", "--epochs", "1"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # Both ranks of the one launcher share its stdout, and a line's text and its newline may
    # reach the pipe in two writes, so one rank's line can end after the other's: look for
    # each record rather than each line.
    trained = sorted(re.findall(r"TRAINED (rank=\d+ world=\d+ sum=\d+ args=--epochs 1)", out))
    assert trained == ["rank=0 world=2 sum=2 args=--epochs 1",
                       "rank=1 world=2 sum=2 args=--epochs 1"], out[-4000:]
