"""The agent store (src/agent/agent_store.h): a node's agent keeps torch's TCPStore server in one
of its spares for its whole life, and the rounds that node leads meet there.

Real etcd, real agents, real gloo workers (workers/allreduce_worker.py, a plain
init_process_group("gloo") program). Bounded in time; every process started is killed by the
fixture (by pid / process group).
"""

import os
import re
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402
from cluster import wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

STORE_RE = re.compile(r"agent store \(pid (\d+)\) listens on port (\d+)")
START_RE = re.compile(r"START round=(\d+) rank=(\d+) world=(\d+) step=\d+ pid=\d+ "
                      r"master_port=(\d+) agent_store=(\w+)")


@pytest.fixture
def job():
    with cluster.running("agent-store-%d" % os.getpid()) as c:
        yield c


def store_of(agent):
    m = STORE_RE.search(agent.output())
    return (int(m.group(1)), int(m.group(2))) if m else None


def starts(agents):
    """{round: [(rank, world, master_port, agent_store)]} over the agents' START lines."""
    out = {}
    for a in agents:
        for m in START_RE.finditer(a.output()):
            out.setdefault(int(m.group(1)), []).append(
                (int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5)))
    return out


def test_rounds_meet_in_the_leading_nodes_agent_store_which_outlives_them(job):
    a = job.start_agent("a", nnodes="1:2")
    job.wait_for_world(1, timeout=90)
    pid, port = wait_for(lambda: store_of(a), 10, "agent a's store")
    assert a.helper_pids("efdl-store") == [pid], a.output()[-3000:]
    b = job.start_agent("b", nnodes="1:2")
    since = time.monotonic()
    job.wait_for_world(2, since=since, timeout=90)
    b.signal_group(signal.SIGKILL)
    b.proc.wait(timeout=30)
    since = time.monotonic()
    job.wait_for_world(1, since=since, timeout=90)
    c = job.start_agent("c", nnodes="1:2")
    since = time.monotonic()
    job.wait_for_world(2, since=since, timeout=90)
    # a led every round (the survivor keeps rank 0): all of them met in a's one store, every
    # rank a client of it, and it is still the same process.
    rounds = starts([a, b, c])
    assert len(rounds) >= 4, rounds
    for r, ranks in rounds.items():
        assert all(p == port and s == "True" for (_, _, p, s) in ranks), (r, ranks)
    assert a.helper_pids("efdl-store") == [pid]
    assert store_of(b) is not None and store_of(b)[1] != port   # b had its own, unused


def test_a_dead_agent_store_leaves_rank_zero_to_host_the_next_rounds_store(job):
    a = job.start_agent("a", nnodes="1:2")
    job.wait_for_world(1, timeout=90)
    pid, port = wait_for(lambda: store_of(a), 10, "agent a's store")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "from the next round on, rank 0's worker hosts the store" in a.output(),
             10, "agent a to notice its store died")
    b = job.start_agent("b", nnodes="1:2")
    since = time.monotonic()
    job.wait_for_world(2, since=since, timeout=90)
    world2 = [ranks for ranks in starts([a, b]).values() if ranks[0][1] == 2]
    assert world2 and all(s == "False" and p != port for (_, _, p, s) in world2[-1]), world2
