"""End to end on hosts that look like real ones (tests/python/workers/hosts.py): each `efdl run`
in its own network, UTS, mount and PID namespace, with a Debian-style /etc/hosts (its own name
-> 127.0.1.1), etcd on the bridge, and default flags only (--etcd --job --nnodes). The program
is a plain init_process_group("gloo") + DDP one (workers/ddp_plain_worker.py).

Every wait is bounded; each test removes its hosts, etcd and directories whatever happens.
"""

import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))

import cluster  # noqa: E402
import hosts  # noqa: E402

WORKER = cluster.HOST_WORKER

_why = hosts.HostWorld.unavailable() or (None if cluster.efdl_bin() else "efdl is not built")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))


world = pytest.fixture(cluster.host_world)
Etcd, host_env, start_agent = cluster.bridge_etcd, cluster.host_env, cluster.start_host_agent
outputs, wait_world = cluster.outputs, cluster.wait_for_world


def test_three_hosts_with_default_flags_train_lose_a_host_and_get_it_back(world):
    w, etcd, agents = world
    job = "hosts-ddp"
    agents += [start_agent(w, etcd, h, job) for h in w.hosts]   # all at once, as pods start
    wait_world(agents, 3, 0.0, timeout=300, live=agents)
    for a, h in zip(agents, w.hosts):
        out = a.output()
        # The default: the address this host reaches etcd from, on its eth0; not 127.0.1.1.
        assert "advertising %s on interface eth0" % h.addr in out, out[-3000:]
        assert "127.0.1.1" not in out, out[-3000:]

    # The third host dies as a whole: its agent and every worker with it.
    lost = w.hosts[2]
    workers_before = [p for p in lost.pids()]
    assert len(workers_before) >= 2, workers_before   # the agent and at least its worker
    killed_at = time.monotonic()
    lost.kill()
    assert agents[2].proc.wait(timeout=30) != 0
    assert lost.pids() == []
    wait_world(agents[:2], 2, killed_at, timeout=120, live=agents[:2])

    # The same host back (same name, address and /dev/shm): the world is 3 again.
    lost.start()
    back_at = time.monotonic()
    agents.append(start_agent(w, etcd, lost, job))
    survivors = agents[:2] + agents[3:]
    wait_world(survivors, 3, back_at, timeout=300, live=survivors)
    for a in survivors:
        assert "could not connect to a peer" not in a.output(), a.output()[-3000:]
    # Every worker, pre-started (the first round at least) or spawned (a round soon after
    # another, before the spare is refilled), had the interface of its host's address and a
    # numeric MASTER_ADDR on the bridge.
    assert any("1 of 1 worker(s) taken from pre-started spares" in a.output() for a in agents)
    nets = [l for a in agents for l in a.output().splitlines() if "] NET rank=" in l]
    assert len(nets) >= 8, outputs(agents)
    for line in nets:
        assert "GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in line, line
        assert "MASTER_ADDR=%s." % w.prefix in line, line


def test_a_wrong_interface_is_explained_once_with_the_address_tried(world):
    """GLOO_SOCKET_IFNAME=lo set by the user on every host: gloo's peers are told 127.0.0.1, on
    their own host, and every round fails. The agent keeps the user's setting, and says once
    which address was tried and what to set."""
    w, etcd, agents = world
    job = "hosts-wrong-iface"
    agents += [start_agent(w, etcd, h, job, extra=["--max-restarts", "1"],
                           env={"GLOO_SOCKET_IFNAME": "lo"}) for h in w.hosts[:2]]
    # With --max-restarts 1 a node gives up after its second failed round; the other one, its
    # own workers having failed too and below MIN now, ends as well ("cannot go on").
    gave_up = cluster.wait_for(lambda: next((a for a in agents if "giving up" in a.output()),
                                            None), 240, "an agent to give up",
                               output=lambda: outputs(agents), interval=0.2)
    assert gave_up.proc.wait(timeout=30) == 1, outputs(agents)
    explained = 0
    for a in agents:
        out = a.output()
        n = out.count("could not connect to a peer at")
        assert n <= 1, out[-4000:]   # once, however many rounds failed
        explained += n
        if n:
            line = next(l for l in out.splitlines() if "could not connect to a peer at" in l)
            assert "127.0.0.1" in line and "--iface" in line, line
            assert "GLOO_SOCKET_IFNAME=lo (set by you)" in line, line
            assert "advertises %s" % next(h.addr for h in w.hosts if h.name == a.name) in line
    assert explained >= 1, outputs(agents)
    # The node that gave up failed more than one round, and said it only once.
    assert gave_up.output().count("restart 1 of 1") == 1, outputs(agents)


def test_a_host_cut_off_is_replaced_and_rejoins_when_its_link_is_back(world):
    """A host's link goes down (no FIN, no RST: as a switch port or a cable): the others go on
    as world 2 once its lease ends (default --ttl 10 s), and when the link is back the same
    agent rejoins and the world is 3 again."""
    w, etcd, agents = world
    job = "hosts-cut"
    agents += [start_agent(w, etcd, h, job) for h in w.hosts]
    wait_world(agents, 3, 0.0, timeout=300, live=agents)
    cut = w.hosts[2]
    cut_at = time.monotonic()
    cut.link_down()
    wait_world(agents[:2], 2, cut_at, timeout=120, live=agents[:2])
    healed_at = time.monotonic()
    cut.link_up()
    wait_world(agents, 3, healed_at, timeout=180, live=agents)


EXAMPLES = os.path.join(cluster.REPO, "examples")


@pytest.mark.parametrize("kind", ["horovod-layer", "torchrun-launcher"])
def test_examples_train_across_hosts_with_default_flags(world, kind):
    """The Horovod-layer example (examples/hvd_state.py: Horovod's API over torch.distributed,
    gloo between hosts), and `efdl run --launcher` with torchrun inside starting 2 workers per
    host (examples/launcher_torchrun.sh): 2 hosts, default network flags, one epoch each, every
    agent exits 0."""
    w, etcd, agents = world
    if kind == "horovod-layer":
        extra, command = [], [cluster.PYTHON, os.path.join(EXAMPLES, "hvd_state.py"),
                              "--epochs", "1"]
    else:
        extra = ["--launcher", "--nproc-per-node", "2"]
        command = [os.path.join(EXAMPLES, "launcher_torchrun.sh"), "--epochs", "1"]
    job = "hosts-" + kind
    agents += [start_agent(w, etcd, h, job, extra=extra, command=command, nnodes="2:2",
                           env={"WORKER_STEP_TIME": ""}) for h in w.hosts[:2]]
    for a in agents:
        try:
            code = a.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError("%s did not finish within 300 s:\n%s" % (a.name,
                                                                          outputs(agents)))
        assert code == 0, outputs(agents)
    out = "".join(a.output() for a in agents)
    assert "training complete" in out, outputs(agents)
    assert "could not connect to a peer" not in out, outputs(agents)
    assert "127.0.1.1" not in out, outputs(agents)


STATE_WORKER = os.path.join(cluster.REPO, "tests", "faults", "worker.py")
RESUME_RE = re.compile(r"RESUME round=(\d+) rank=(\d+) world=(\d+) step=(\d+) pid=\d+ src=(\d)")


def resumes(agent):
    """(round, rank, world, step, source) of each RESUME line of the fault suite's worker
    (source: 0 none, 1 memory, 2 storage, 3 peer)."""
    return [tuple(int(g) for g in m.groups())
            for m in (RESUME_RE.search(line) for line in agent.output().splitlines()) if m]


@pytest.mark.parametrize("shm", ["kept", "empty"])
def test_a_state_job_whose_hosts_restart_resumes_from_their_memory(world, shm):
    """The fault suite's digits + State program (commit every step) on 2 hosts with default
    flags. Both hosts are SIGKILLed as a whole at once and started again: with their /dev/shm
    kept (a process or container restart), every rank restores from its own host's memory at
    the last acknowledged commit or the one after it; with an empty /dev/shm (machines
    replaced), from storage or a peer, never from memory."""
    w, etcd, agents = world
    job = "hosts-state-" + shm
    marks = os.path.join(w.shared, "marks")
    os.makedirs(marks)
    env = {"FAULT_STEPS": "100000", "FAULT_STEP_TIME": "0.1", "FAULT_MARK_DIR": marks,
           "FAULT_ANNOUNCE": "1", "WORKER_STEP_TIME": ""}
    pair = w.hosts[:2]
    first = [start_agent(w, etcd, h, job, env=env, nnodes="2:2",
                         command=[cluster.PYTHON, STATE_WORKER]) for h in pair]
    agents += first
    wait_world(first, 2, 0.0, timeout=300, live=first)
    cluster.wait_for(lambda: max((s[4] for a in first for s in a.steps()), default=0) >= 15,
                     120, "15 steps at world 2")
    for h in pair:
        h.kill()
    # Commits acknowledged before the kill: ack-<pid>-<step> markers, written once commit()
    # returned (they survive the kill; the agents' relayed lines may not).
    acked = max(int(n.rsplit("-", 1)[1]) for n in os.listdir(marks) if n.startswith("ack-"))
    for h in pair:
        h.start(empty_shm=(shm == "empty"))
    second = [start_agent(w, etcd, h, job, env=env, nnodes="2:2",
                          command=[cluster.PYTHON, STATE_WORKER]) for h in pair]
    agents += second
    got = cluster.wait_for(lambda: len(resumes(second[0]) + resumes(second[1])) >= 2 and
                           resumes(second[0]) + resumes(second[1]), 300,
                           "both ranks of the restarted hosts resuming:\n" + outputs(second))
    steps = {r[3] for r in got}
    sources = {r[4] for r in got}
    assert len(steps) == 1, got        # the ranks agreed on one snapshot
    step = steps.pop()
    if shm == "kept":
        assert sources == {1}, (got, outputs(second))
        assert acked <= step <= acked + 1, (acked, got)
    else:
        assert 1 not in sources and sources & {2, 3}, (got, outputs(second))
        assert 0 < step <= acked + 1, (acked, got)
