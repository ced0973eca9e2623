"""Hangs (issue #32): a rank that stops making progress while its process and its node look
healthy. Three nodes of the digits + State program (worker.py, a commit every step), real etcd
and agents; `--hang-timeout 10` unless said otherwise.

Each case checks that training goes on within the target (13 s of the hang; the bound asserted
is HANG_BOUND, since this 2-core machine is shared: the measured figure is printed), that the
log names the rank and holds the stacks, that the failure is counted against the node that
caused it and no other, and the usual end checks (every step once per round, restored states
intact, the job finishes, nothing left behind).
"""

import os
import re
import signal
import time

import pytest

import faultlib

pytestmark = pytest.mark.skipif(faultlib.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

TIMEOUT = 10
# The cases where nothing may be named (a long announced pause, a long first step) need no
# particular timeout, only a pause or first step longer than it: they run under this shorter one,
# which their pause and first step are scaled to (the test's time is mostly those).
QUIET_TIMEOUT = 5
# The target is 13 s from the hang to the next step; the assertion leaves room for a
# loaded 2-core machine (the figure is printed on every run).
HANG_BOUND = 20.0
# The process group's own timeout, far beyond the hang timeout: gloo must not be what ends it.
ENV = {"FAULT_PG_TIMEOUT": "600"}


def start(job, env=None, timeout=TIMEOUT):
    for n in ("node-a", "node-b", "node-c"):
        job.start_node(n, extra=["--hang-timeout", str(timeout)], env=env)
    job.wait_step(3, world=3)


def node_of_rank(job, rank, round_=1):
    for e in job.events({"STEP"}):
        if e["rank"] == rank and e["round"] == round_:
            return e["node"]
    raise AssertionError("no STEP of rank %d in round %d\n%s" % (rank, round_, job.dump()))


def recovered_after(job, t0):
    """The first STEP of a later round after wall time t0 (waits for it)."""
    def found():
        steps = [e for e in job.events({"STEP"}) if e["t"] > t0 and e["round"] > 1]
        return min(e["t"] for e in steps) if steps else None
    return job.wait_for(found, 90, "a step of a new round after the hang")


def agent_lines(job, name):
    return job.nodes[name].own_output().splitlines()


def check_blame(job, culprit, rank, cause):
    """The culprit's node named the rank and the cause and ended its workers; the other nodes
    wrote their stacks, said the cause is elsewhere and counted nothing."""
    out = "\n".join(agent_lines(job, culprit))
    assert re.search(r"rank %d .*made no progress for [\d.]+ s \(hang timeout %d s\)" % (
        rank, TIMEOUT), out), job.dump()
    assert re.search(r"rank %d made no progress for \d+ s \(%s" % (rank, cause), out), job.dump()
    assert "the hang is this node's (%s)" % culprit in out, job.dump()
    for other in job.nodes:
        if other == culprit:
            continue
        text = "\n".join(agent_lines(job, other))
        assert "restart 1 of" not in text, "node %s counted a failure\n%s" % (other, job.dump())
        # It detected the hang too (its own detection line, not the round's close reason that
        # quotes the culprit's): stacks, never its fault.
        if "on node %s made no progress" % other in text:
            assert "its Python stack" in text, job.dump()
            assert "the hang is this node's" not in text, job.dump()
    assert "restart 1 of" in out, "the culprit's node did not count its failure\n" + job.dump()


def test_a_rank_sleeping_outside_collectives_is_ended_by_its_node(make_job):
    job = make_job("hang-sleep", steps=60, nnodes="3:3",
                   env=dict(ENV, FAULT_HANG="1:20"))
    start(job)
    hang = job.wait_for(lambda: job.events({"HANGING"}), 90, "the hang")[0]
    culprit = hang["node"]
    first = recovered_after(job, hang["t"])
    print("hang at %.3f on %s; training again %.2f s later (timeout %d s)" % (
        hang["t"], culprit, first - hang["t"], TIMEOUT))
    assert first - hang["t"] <= HANG_BOUND, job.dump()
    check_blame(job, culprit, 1, "not in a collective")
    out = "\n".join(agent_lines(job, culprit))
    assert re.search(r"\[rank 1\]\s+File \".*worker\.py\", line \d+ in main", out), (
        "the sleeping rank's stack is not in the log\n" + job.dump())
    job.check_all(list(job.nodes))
    job.check_no_leftovers()


# Back in `make test`: it was soak-only after 2 of about 5 runs failed a blame check (a healthy
# node's rank dumped while its collective was already failing); with the confirmation of a
# culprit outside collectives (agent_health.cc, kHangConfirm) and the blame fixes since, 9 of 9
# runs passed on 2026-12-06 (training again 10.3-11.3 s after the SIGSTOP, load 2-4).
def test_a_stopped_worker_with_a_healthy_agent_is_ended_by_its_node(make_job):
    job = make_job("hang-stop", steps=60, nnodes="3:3", env=ENV)
    start(job)
    job.wait_step(15, world=3)
    victim = "node-b"
    pid = job.worker_pid(victim)
    t0 = time.time()
    os.kill(pid, signal.SIGSTOP)
    rank = next(e["rank"] for e in job.events({"RESUME"}) if e["pid"] == pid)
    first = recovered_after(job, t0)
    print("SIGSTOP of rank %d (pid %d) at %.3f; training again %.2f s later" % (
        rank, pid, t0, first - t0))
    assert first - t0 <= HANG_BOUND, job.dump()
    check_blame(job, victim, rank, "stopped")
    job.check_all(list(job.nodes))
    job.check_no_leftovers()


def test_an_announced_pause_longer_than_the_timeout_is_not_a_hang(make_job):
    # An "evaluation" of 2.5 x the timeout at step 12, announced with efdl.pause_expected.
    job = make_job("hang-pause", steps=20, nnodes="3:3",
                   env=dict(ENV, FAULT_PAUSE="12:%d" % int(QUIET_TIMEOUT * 2.5)))
    start(job, timeout=QUIET_TIMEOUT)
    job.check_finished(list(job.nodes), timeout=180)
    assert job.events({"PAUSING"}), job.dump()
    for name in job.nodes:
        text = "\n".join(agent_lines(job, name))
        assert "made no progress" not in text, job.dump()
    assert {e["round"] for e in job.events({"STEP"})} == {1}, job.dump()
    job.check_no_leftovers()


def test_a_first_step_longer_than_the_timeout_is_not_a_hang(make_job):
    # Every process's first step takes 1.5 x the timeout more (a compile), unannounced; steps
    # after it take ~0.1 s, so it is >100x slower than the rest. Round 1's first step is not
    # judged (the program has not reported yet); after node-c is killed the survivors' new
    # processes are, and the grace before a round's first progress (hang_rules.h: 300 s under
    # an explicit timeout) covers them.
    job = make_job("hang-first", steps=40, nnodes="2:3",
                   env=dict(ENV, FAULT_FIRST_STEP=str(QUIET_TIMEOUT * 1.5)))
    start(job, timeout=QUIET_TIMEOUT)
    job.wait_step(8, world=3)
    job.kill_node("node-c")
    job.check_finished(["node-a", "node-b"], timeout=180)
    slow = job.events({"SLOWFIRST"})
    assert {e["round"] for e in slow} >= {1} and max(e["round"] for e in slow) > 1, job.dump()
    for name in ("node-a", "node-b"):
        text = "\n".join(agent_lines(job, name))
        assert "made no progress" not in text, job.dump()
    job.check_no_leftovers()
