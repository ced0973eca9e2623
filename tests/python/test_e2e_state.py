"""End-to-end: efdl.State under `efdl run` with several agents on one real etcd (loopback), workers
training digits with DDP over gloo (workers/state_worker.py).

Each node gets its own shared-memory directory and its own storage directory, as separate
machines would; storage is written rarely (EFDL_PERSIST_MIN_INTERVAL_MS), so a node that restored
from its own storage would come back at an older step than the nodes' memory copies - the
cross-rank agreement is what makes every rank restore the same, newest step.
"""

import os
import re
import signal
import sys
import time

import pytest
import torch

from conftest import PYTHON

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "state_worker.py")
RESTORED_RE = re.compile(r"^(?:\[rank \d+\] )?RESTORED round=(\d+) rank=(\d+) world=(\d+) "
                         r"source=(\w+) seq=(\d+) step=(\d+) digest=(\w+)")
# What a rank sees when a peer left a collective it was still in.
GLOO_ERRORS = ("Connection reset", "Connection closed by peer", "gloo", "Traceback")


@pytest.fixture
def job():
    with cluster.running("e2e-state-%d" % os.getpid()) as c:
        yield c


def start_node(job, name, env, **kwargs):
    shm = os.path.join(job.dir, "shm-" + name)
    os.makedirs(shm, exist_ok=True)
    node_env = dict(env, EFDL_SHM_DIR=shm)
    return job.start_agent(name, env=node_env, command=[PYTHON, WORKER],
                           snapshot_dir=os.path.join(job.dir, "storage-" + name), **kwargs)


def restored(agents, round_=None):
    """{(round, rank): (world, source, seq, step, digest)} of the RESTORED lines."""
    out = {}
    for a in agents:
        for line in a.output().splitlines():
            m = RESTORED_RE.match(line)
            if m and (round_ is None or int(m.group(1)) == round_):
                out[(int(m.group(1)), int(m.group(2)))] = (
                    int(m.group(3)), m.group(4), int(m.group(5)), int(m.group(6)), m.group(7))
    return out


def wait_restored(agents, world, since, timeout=90):
    """Waits for a round of `world` ranks that all printed RESTORED after `since`; returns
    (round, {rank: (source, step, digest)})."""
    def found():
        rounds = {}
        for (round_, rank), (w, source, _, step, dig) in restored(agents).items():
            if w == world:
                rounds.setdefault(round_, {})[rank] = (source, step, dig)
        fresh = {r for a in agents for _, _, r, w, _ in a.steps(since) if w == world}
        return next(((round_, ranks) for round_, ranks in rounds.items()
                     if len(ranks) == world and round_ in fresh), None)
    return cluster.wait_for(found, timeout, "a round of world %d that restored" % world,
                            output=lambda: cluster.outputs(agents, 3000), interval=0.1)


def last_steps(agents, round_):
    """{rank: last step} of the given round."""
    out = {}
    for a in agents:
        for _, rank, r, _, step in a.steps():
            if r == round_:
                out[rank] = max(out.get(rank, -1), step)
    return out


def test_newcomer_gets_the_newest_step_and_graceful_changes_lose_nothing(job):
    env = {"WORKER_EPOCHS": "1000", "WORKER_STEP_TIME": "0.05", "WORKER_COMMIT_INTERVAL": "4",
           "EFDL_PERSIST_MIN_INTERVAL_MS": "3600000"}
    a = start_node(job, "node-a", env)
    job.wait_joined(a)
    b = start_node(job, "node-b", env)
    first, _ = wait_restored([a, b], 2, since=0.0)
    cluster.wait_for(lambda: max((s[4] for s in a.steps()), default=0) >= 12, 60,
                     "step 12 (past the first storage write)", output=lambda: a.output()[-3000:],
                     interval=0.1)

    # Scale out: node-c has empty shared memory and storage; the round change is graceful.
    joined_at = time.monotonic()
    c = start_node(job, "node-c", env)
    grown, ranks = wait_restored([a, b, c], 3, since=joined_at)
    before = last_steps([a, b], first)
    assert len(set(before.values())) == 1, before          # both ranks stopped at one commit
    assert {step for _, step, _ in ranks.values()} == {max(before.values())}, (before, ranks)
    assert len({dig for _, _, dig in ranks.values()}) == 1, ranks
    assert sorted(src for src, _, _ in ranks.values()) == ["memory", "memory", "peer"], ranks

    # Graceful scale in: node-c leaves; the others go on at world 2 from c's last step.
    left_at = time.monotonic()
    c.proc.send_signal(signal.SIGTERM)
    assert c.wait(60) == 128 + signal.SIGTERM
    shrunk, ranks = wait_restored([a, b], 2, since=left_at)
    before = last_steps([a, b, c], grown)
    assert len(set(before.values())) == 1, before
    assert {step for _, step, _ in ranks.values()} == {max(before.values())}, (before, ranks)
    assert len({dig for _, _, dig in ranks.values()}) == 1, ranks
    for x in (a, b, c):
        for bad in GLOO_ERRORS:
            assert bad not in x.output(), x.output()[-4000:]


def test_final_model_after_a_crash_matches_an_uninterrupted_run(job, spawn_ranks, tmp_path):
    common = {"WORKER_EPOCHS": "2", "WORKER_COMMIT_INTERVAL": "4"}
    # The uninterrupted run: the same worker as two plain gloo ranks, no agent.
    reference = str(tmp_path / "reference.pt")
    results = spawn_ranks([PYTHON, WORKER], 2, timeout=120, env=dict(
        common, EFDL_JOB_ID="reference-" + tmp_path.name, WORKER_SAVE=reference,
        EFDL_SHM_DIR=str(tmp_path), EFDL_SNAPSHOT_DIR=str(tmp_path / "storage")))
    for r in results:
        assert "FINAL " in r.stdout, r.stderr[-3000:]
        assert r.returncode == 0, r.stderr[-3000:]  # no exit-time abort (_dist._destroy_at_exit)

    crashed = str(tmp_path / "crashed.pt")
    env = dict(common, WORKER_CRASH_AT="30", WORKER_CRASH_MARKER=str(tmp_path / "crashed"),
               WORKER_SAVE=crashed)
    a = start_node(job, "node-a", env, nnodes="2:2")
    job.wait_joined(a)
    b = start_node(job, "node-b", env, nnodes="2:2")
    assert a.wait(150) == 0, a.output()[-3000:]
    assert b.wait(30) == 0, b.output()[-3000:]

    rounds = sorted({r for r, _ in restored([a, b])})
    # One crash: at least one restart (a rendezvous may take more than one round to settle).
    assert len(rounds) >= 2, a.output()[-3000:] + b.output()[-3000:]
    after = restored([a, b], rounds[1])
    # Rank 1 died after step 30; the last commit was step 28: at most one interval lost.
    assert {v[3] for v in after.values()} == {28}, after
    assert {v[1] for v in after.values()} == {"memory"}, after

    # Same initial weights, the same samples in the same order (exact resume), the same reduction
    # order (2 ranks of gloo both times) and the restored optimizer momentum: the replayed steps
    # compute exactly what the uninterrupted run computed, so the weights must agree to the last
    # bit; 1e-6 leaves room only for a different float summation order, not for a lost or
    # repeated step (one step moves the weights by about 1e-3 here).
    want, got = torch.load(reference), torch.load(crashed)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.allclose(want[key], got[key], rtol=0, atol=1e-6), key
