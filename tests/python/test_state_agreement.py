"""Cross-rank agreement of efdl.State (python/efdl/_agreement.py): the decision logic, and real
gloo groups of 3 ranks on loopback, each rank playing a node with its own shared-memory and
storage directories (what separate machines see)."""

import os
import textwrap

import pytest
import torch

from conftest import PYTHON

from efdl import _agreement
from efdl._agreement import Decision, NoCommonSnapshotError, decide
from efdl.state import State


def test_newest_snapshot_of_any_rank_wins_and_lacking_ranks_receive_it():
    # rank 0: older memory copy; rank 1 and 3: the newest; rank 2: a newcomer with nothing.
    offers = [[(5, 20)], [(6, 24)], [], [(6, 24)]]
    assert decide(offers) == Decision((6, 24), [1, 3], {0: 1, 2: 3})


def test_same_seq_with_another_step_is_not_the_same_snapshot():
    d = decide([[(6, 24)], [(6, 30)]])
    assert d.key == (6, 30) and d.holders == [1] and d.receive_from == {0: 1}


def test_nobody_holding_a_snapshot_means_a_fresh_start_everywhere():
    assert decide([[], [], []]) == Decision(None, [], {})
    assert decide([[], []], per_rank=True) == Decision(None, [], {})


def test_per_rank_snapshots_restore_the_newest_step_every_rank_holds():
    offers = [[(7, 28), (6, 24)], [(6, 24), (5, 20)], [(7, 28), (6, 24), (5, 20)]]
    assert decide(offers, per_rank=True) == Decision((6, 24), [0, 1, 2], {})


def test_per_rank_snapshots_without_a_common_step_are_a_clear_error():
    with pytest.raises(NoCommonSnapshotError, match=r"rank 1: none.*restart at the world size"):
        decide([[(7, 28)], []], per_rank=True)


def test_packed_layout_aligns_every_tensor():
    offsets, total = _agreement.packed_layout([("a", "float32", [3], 12), ("b", "int64", [9], 72),
                                               ("c", "uint8", [0], 0)])
    assert offsets == [0, 64, 192] and total == 192


# Phase 1 (in this process, one State per "node", no process group): commit `commits` snapshots
# of a model whose weights are filled with value, value + 1, ..., the last at `step`.
def write_snapshots(tmp_path, nodes, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EFDL_CONTROL_SOCKET",
                "EFDL_SNAPSHOT_PER_RANK", "EFDL_AGENT_PERSISTS"):
        monkeypatch.delenv(var, raising=False)
    for node, (value, step, commits) in nodes.items():
        for k, v in node_env(tmp_path, node).items():
            monkeypatch.setenv(k, v)
        model = torch.nn.Linear(4, 3)
        st = State(model, step=0, tag="")
        for i in range(commits):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(value + i)
            st.step = step - (commits - 1 - i)
            st.tag = "written by " + node
            st.commit()
        st.flush()


# Phase 2 (a gloo group of 3): every rank restores and reports; then the ranks' agents ask for a
# stop at different commit() calls (simulated: State's control client is the agent's socket, so
# here the stop vote runs alone), with the training step's own collectives interleaved.
READ = textwrap.dedent("""
    import time
    import torch
    import efdl.backend.torch as efdl
    from efdl import _agreement
    efdl.init(timeout=60)
    rank = efdl.get_rank()
    model = torch.nn.Linear(4, 3)
    st = efdl.State(model, step=0, tag="")
    src = st.restored_from
    seq = st._engine.next_seq
    vote = _agreement.StopVote()
    sees = {0: 9, 1: 5, 2: 7}[rank]     # the call at which this rank's agent asks to stop
    stop = -1
    for call in range(3000):
        x = torch.ones(1)
        torch.distributed.all_reduce(x)
        if rank == 2:
            time.sleep(0.0005)          # ranks measure different times per call
        if vote.poll(call >= sees):
            stop = call
            break
    print("rank=%d source=%s step=%d tag=%s weight=%.3f seq=%d stop=%d" % (
        rank, src[0] if src else "none", st.step, st.tag.replace(" ", "_"),
        model.weight.flatten()[0].item(), seq, stop))
""")


def node_env(tmp_path, node):
    shm = tmp_path / ("shm-" + node)
    shm.mkdir(exist_ok=True)
    return {"EFDL_JOB_ID": "agree-" + tmp_path.name, "EFDL_NODE_ID": node,
            "EFDL_SHM_DIR": str(shm), "EFDL_SNAPSHOT_DIR": str(tmp_path / ("storage-" + node)),
            "EFDL_PERSIST_MIN_INTERVAL_MS": "0"}


def restore_in_group(tmp_path, spawn_ranks):
    nodes = ["n0", "n1", "n2"]
    results = spawn_ranks([PYTHON, "-c", READ], 3, timeout=90,
                          rank_env=lambda r: dict(node_env(tmp_path, nodes[r]), LOCAL_RANK="0",
                                                  LOCAL_WORLD_SIZE="1"))
    lines = []
    for r in results:
        assert r.returncode == 0, r.stderr
        lines.append(dict(kv.split("=", 1) for kv in r.stdout.split("\n")[-2].split(" ")))
    return lines


def test_ranks_restore_the_newest_step_of_any_node_and_align_their_seqs(tmp_path, spawn_ranks,
                                                                        monkeypatch):
    # n0 holds an older step (seq 1), n1 the newest (seq 3), n2 is a new node with nothing.
    write_snapshots(tmp_path, {"n0": (1.0, 7, 1), "n1": (5.0, 12, 3)}, monkeypatch)
    out = restore_in_group(tmp_path, spawn_ranks)
    assert [o["source"] for o in out] == ["peer", "memory", "peer"], out
    assert {o["step"] for o in out} == {"12"}, out
    assert {o["tag"] for o in out} == {"written_by_n1"}, out
    assert {o["weight"] for o in out} == {"7.000"}, out
    # Every engine continues after the highest seq any rank had: one seq, one commit.
    assert {o["seq"] for o in out} == {"4"}, out
    # The first stop request (rank 1, call 5) is seen by every rank at the same later call: at
    # the vote after the one that carried it (votes are spaced by time, at most 200 calls).
    stops = {o["stop"] for o in out}
    assert len(stops) == 1, out
    assert 6 <= int(stops.pop()) <= 5 + 2 * 200, out


def test_a_rank_whose_memory_copy_was_lost_receives_it(tmp_path, spawn_ranks, monkeypatch):
    write_snapshots(tmp_path, {node: (2.0, 30, 2) for node in ("n0", "n1", "n2")}, monkeypatch)
    for name in os.listdir(tmp_path / "shm-n1"):
        os.unlink(tmp_path / "shm-n1" / name)          # n1 rebooted: storage holds seq 2 only
    for name in os.listdir(tmp_path / "storage-n1" / ("agree-" + tmp_path.name)):
        if name.endswith("0000000002.efdl"):
            os.unlink(tmp_path / "storage-n1" / ("agree-" + tmp_path.name) / name)
    out = restore_in_group(tmp_path, spawn_ranks)
    assert [o["source"] for o in out] == ["memory", "peer", "memory"], out
    assert {o["step"] for o in out} == {"30"} and {o["weight"] for o in out} == {"3.000"}, out


# Slow steps (30 ms: a vote every call) with a burst of two commit() calls at each "epoch's
# end" (every 10 steps), as examples/train_ddp_state.py does: a stop seen at call 45 must take
# effect within a few calls. A spacing computed from the burst alone (two calls microseconds
# apart) once stretched the next vote to 200 calls, so a graceful leave came too late.
BURST = textwrap.dedent("""
    import time
    import torch
    import efdl.backend.torch as efdl
    from efdl import _agreement
    efdl.init(timeout=60)
    vote = _agreement.StopVote()
    stop = -1
    for call in range(300):
        if call % 11 != 10:
            time.sleep(0.03)
            x = torch.ones(1)
            torch.distributed.all_reduce(x)
        if vote.poll(call >= 45):
            stop = call
            break
    print("stop=%d" % stop)
""")


def test_a_burst_of_commits_does_not_stretch_the_stop_vote(spawn_ranks):
    results = spawn_ranks([PYTHON, "-c", BURST], 2, timeout=90,
                          rank_env=lambda r: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    stops = set()
    for r in results:
        assert r.returncode == 0, r.stderr
        stops.add(int(r.stdout.strip().split("=")[1]))
    assert len(stops) == 1, stops
    assert 46 <= stops.pop() <= 45 + 2 * 4, stops  # votes stay about 50 ms (2 calls) apart
