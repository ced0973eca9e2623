"""Blame (issue #32, part 4; docs/operations.md "Nodes that keep failing"): every failure is
attributed to its cause, on both paths (efdl.elastic.run's in-process round changes, and the
restart path), by real agents on one real etcd with real gloo DDP workers
(workers/elastic_run_worker.py). Three nodes, one process each:

- a rank that exits 0 before the job is complete while its peers still train: its node logs
  "rank N exited 0 before the job completed" and counts it (RESTARTS 1 in `efdl status`), the
  round's reason names it, the peers' collective failures are collateral (never counted);
- a node SIGKILLed: the round's reason names the dead node, never a survivor whose collective
  lost it, and no survivor's log says its workers failed;
- under efdl.elastic.run, a node whose program raises ValueError every round: that node's
  agent logs its worker's failures, counts them and is excluded after --exclude-after 2; the
  healthy nodes never count a failure, give up or get excluded, and finish the job.
A fourth case runs two nodes of two processes: one rank of a node returns early while the rank
beside it trains on; that node counts it, though its other rank's failure looks like a lost peer.
Short settings as in test_e2e_elastic_run.py (--ttl 3, --last-call 1, --stop-grace 3).
"""

import json
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

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                      "elastic_run_worker.py")
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture
def job():
    c = cluster.Cluster(job="blame-%d" % os.getpid())
    try:
        c.start_etcd()
        yield c
    finally:
        c.close()


def efdl(c, *args):
    proc = subprocess.run([cluster.efdl_bin()] + list(args) + ["--etcd", c.endpoint, "--job",
                                                               c.job],
                          env=cluster.base_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def status(c):
    return json.loads(efdl(c, "status", "--json"))


def outputs(agents):
    return cluster.outputs(agents, 3000, own=True)


wait_line = cluster.wait_for_log


def node_of_exit0(agents):
    """The agent whose worker ran rank 1 when it returned (its worker's own line says so)."""
    return cluster.wait_for(
        lambda: next((a for a in agents if "] EXITING0 rank=1 " in a.output()), None), 90,
        "rank 1's worker to return", output=lambda: outputs(agents))


def start_three(c, env, extra=(), nnodes="2:3", envs=None):
    agents = []
    for n in NODES:
        e = dict(env)
        e.update((envs or {}).get(n, {}))
        agents.append(c.start_agent(n, env=e, nnodes=nnodes, extra=["--no-prestart"] + list(extra),
                                    command=[cluster.PYTHON, WORKER]))
    c.wait_for_world(3, agents=agents, timeout=120)
    return agents


def mode_env(mode, env):
    env = dict(env)
    if mode == "restart":
        env["WORKER_MODE"] = "restart"
    return env


@pytest.mark.parametrize("mode", ["in-process", "restart"])
def test_a_rank_that_exits_0_before_the_job_completed_is_blamed_on_its_node(job, mode):
    marks = os.path.join(job.dir, "marks")
    os.makedirs(marks)
    # Each process's exit takes 2.5 s more once efdl destroyed its process group (a big model's
    # teardown). In-process the group's sockets close there: the exit is reaped after the
    # coordinator stopped waiting for a cause and after the round's close waited for it, so the
    # node must say that its rank returned before that ("returned"). On the restart path the
    # peers lose the rank only when its process is gone (the group's sockets live as long as
    # the program's objects on it), so its exit is reaped with their failure.
    env = mode_env(mode, {"WORKER_STEPS": "120", "WORKER_STEP_TIME": "0.03",
                          "WORKER_EXIT0": "1:30", "WORKER_MARK_DIR": marks,
                          "WORKER_SLOW_TEARDOWN": "2.5"})
    agents = start_three(job, env)
    exiting = node_of_exit0(agents)
    peers = [a for a in agents if a is not exiting]
    # Its node says so and counts it; the next round's reason names it.
    wait_line(exiting, r"round \d+: rank 1 exited 0 before the job completed: their peers' "
                       r"collectives lost them", 60, agents)
    wait_line(exiting, r"restart 1 after rank 1 exited 0 before the job completed", 30, agents)
    st = status(job)
    assert st["message"].startswith("workers of node %s failed: rank 1 exited 0 before the job "
                                    "completed" % exiting.name), st
    restarts = {m["id"]: m["restarts"] for m in st["members"]}
    assert restarts == {a.name: int(a is exiting) for a in agents}, st

    for a in agents:   # the exit was once per job: it completes
        assert a.wait(120) == 0, outputs(agents)
    events = json.loads(efdl(job, "events", "--json"))["events"]
    assert any("rank 1 exited 0 before the job completed" in e["why"] for e in events), events
    # The peers' collectives lost the rank: collateral, logged (by those whose failure reached
    # their agent before the round's close paused them), never counted, never "failed".
    assert any("not counted as a restart" in p.own_output() for p in peers), outputs(agents)
    for p in peers:
        out = p.own_output()
        assert not re.search(r"restart \d+ ", out), out
        assert "workers of node %s failed" % p.name not in out, out
        assert "exited 0 before the job completed: their peers" not in out, out


@pytest.mark.parametrize("mode", ["in-process", "restart"])
def test_one_of_a_nodes_ranks_exiting_0_early_is_blamed_on_its_node(job, mode):
    """Two nodes of two processes: rank 1 returns at step 30 while rank 0 beside it trains on.
    Rank 0's collective then fails on a lost peer (it exits 1, or waits in-process) like the other
    node's ranks: without the early exit's record that failure looked collateral on both nodes
    and nobody counted anything."""
    marks = os.path.join(job.dir, "marks")
    os.makedirs(marks)
    env = mode_env(mode, {"WORKER_STEPS": "100", "WORKER_STEP_TIME": "0.03",
                          "WORKER_EXIT0": "1:30", "WORKER_MARK_DIR": marks})
    agents = [job.start_agent(n, env=env, nnodes="2:2", nproc=2,
                              extra=["--no-prestart"], command=[cluster.PYTHON, WORKER])
              for n in NODES[:2]]
    job.wait_for_world(4, agents=agents, timeout=120)
    exiting = node_of_exit0(agents)
    peer = next(a for a in agents if a is not exiting)
    wait_line(exiting, r"round \d+: rank 1 exited 0 before the job completed while this node's "
                       r"other ranks trained", 60, agents)
    wait_line(exiting, r"restart 1 (of \d+ )?after rank 1 exited 0 before the job completed", 30, agents)
    st = status(job)
    restarts = {m["id"]: m["restarts"] for m in st["members"]}
    assert restarts == {exiting.name: 1, peer.name: 0}, (st, outputs(agents))
    for a in agents:
        assert a.wait(120) == 0, outputs(agents)
    events = json.loads(efdl(job, "events", "--json"))["events"]
    assert any("workers of node %s failed: rank 1 exited 0 before the job completed"
               % exiting.name in e["why"] for e in events), (
        "\n".join(e["why"] for e in events) + "\n" + outputs(agents))
    out = peer.own_output()
    assert not re.search(r"restart \d+ ", out), out
    assert "workers of node %s failed" % peer.name not in out, out


@pytest.mark.parametrize("mode", ["in-process", "restart"])
def test_a_sigkilled_node_is_the_cause_not_the_survivor_that_reported_first(job, mode):
    env = mode_env(mode, {"WORKER_STEPS": "150", "WORKER_STEP_TIME": "0.03"})
    agents = start_three(job, env)
    victim = agents[2]
    survivors = agents[:2]
    time.sleep(0.5)
    killed = time.monotonic()
    victim.signal_group(signal.SIGKILL)
    victim.wait(10)
    job.wait_for_world(2, since=killed, agents=survivors, timeout=60)
    st = status(job)
    assert re.match(r"node node-c (stopped answering|is gone)", st["message"]), st
    assert st["message"].endswith("lost it"), st
    for a in survivors:
        assert a.wait(120) == 0, outputs(agents)
    events = json.loads(efdl(job, "events", "--json"))["events"]
    crash = [e for e in events if "node-c" in e["why"]]
    assert crash and crash[0]["kind"] == "crash", events
    for a in survivors:
        out = a.own_output()
        # A survivor says its workers lost a peer, never that they (or a peer's) failed.
        for n in NODES[:2]:
            assert "workers of node %s failed" % n not in out, out
        assert not re.search(r"restart \d+ ", out), out


def test_in_process_a_node_that_keeps_raising_is_excluded_and_its_peers_never_count(job):
    """Item 3 of the blame work: node-c's program raises ValueError at step 25 of every round it
    reaches it in (WORKER_RAISE any:25, given to node-c only: whatever rank it holds)."""
    env = {"WORKER_STEPS": "160", "WORKER_STEP_TIME": "0.03"}
    extra = ["--exclude-after", "2", "--exclude-window", "120", "--exclude-cooldown", "300"]
    agents = start_three(job, env, extra=extra,
                         envs={"node-c": {"WORKER_RAISE": "any:25"}})
    a, b, c = agents
    # node-c logs its worker's own failure and counts it, then is excluded after the second.
    # (How: the exception its worker said it raised, or the exit status, whichever came first.)
    how = r"rank \d (raised ValueError: a bug in the program at step 25|exited with status 1)"
    wait_line(c, r"restart 1 after " + how, 90, agents)
    wait_line(c, r"node node-c is excluded from job '%s' for 300 s \(exclusion 1\): %s"
                 % (job.job, how), 90, agents)
    # Each exception of its program was seen and counted: exactly two tracebacks in node-c's
    # output, the exclusion counted both (an exception hidden by the round's close would be one
    # more, counted by nobody). The second may be printed just after the exclusion line: the
    # worker says `raised` to its agent before its traceback reaches the output.
    def tracebacks():
        return re.findall(r"^\[rank \d\] ValueError: a bug in the program at step 25$",
                          c.output(), re.M)
    cluster.wait_for(lambda: len(tracebacks()) >= 2, 15, "node-c's second traceback",
                     output=lambda: outputs(agents))
    # The next record of the job's rounds leaves it out (the exclusion is written first).
    def left_out():
        st = status(job)
        listed = st["members"] + st["standbys"] + st["waiting"]
        return None if any(m["id"] == "node-c" for m in listed) else st
    st = cluster.wait_for(left_out, 30, "a record of the rounds without node-c",
                          output=lambda: "%s\n%s" % (status(job), outputs(agents)),
                          interval=0.1)
    assert set(st["excluded"]) == {"node-c"}, (st, outputs(agents))
    assert st["excluded"]["node-c"]["failures"] == 2, st
    assert not st["gave_up"], st
    for m in st["members"] + st["standbys"] + st["waiting"]:
        assert m["restarts"] == 0, (st, outputs(agents))
    # The healthy nodes finish the job without node-c; node-c, excluded, learns it and exits 0.
    for x in (a, b, c):
        assert x.wait(150) == 0, outputs(agents)
    assert len(tracebacks()) == 2, (len(tracebacks()), outputs(agents))
    # The healthy nodes learnt the cause from node-c (its worker said `raised` before tearing
    # down: usually before their own collectives failed), or saw their collectives lose it.
    for x in (a, b):
        assert re.search(r"closing \(not graceful\): workers of node node-c failed: rank \d raised "
                         r"ValueError|came from a collective that lost a peer", x.own_output()), \
            outputs(agents)
    for x in (a, b):
        out = x.own_output()
        # node-c withdrew when it counted the failure that excluded it, before a round formed
        # with it: the healthy workers never waited in a round's group creation for its rank
        # (they kept their processes: no pause timeout, no restart).
        for bad in ("is excluded", "giving up", "counted as this node's",
                    "workers of node %s failed" % x.name, "did not pause within",
                    "this node's workers are restarted"):
            assert bad not in out, (bad, out)
        assert not re.search(r"restart \d+ ", out), out
    # The rounds node-c broke were re-formed naming it (the rounds' reasons in `efdl events`),
    # whichever node's report came first; no round names a healthy node.
    whys = [e["why"] for e in json.loads(efdl(job, "events", "--json"))["events"]]
    assert any(re.search(r"workers of node node-c failed: rank \d (raised ValueError|exited with "
                         r"status 1)", w) for w in whys), "\n".join(whys)
    assert not any(re.search(r"workers of node node-[ab] failed", w) for w in whys), whys
    history = [e["message"] for e in st["events"]]
    assert not any(re.search(r"workers of node node-[ab] failed", m) for m in history), history
