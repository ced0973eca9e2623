"""The pure logic of resharding a ZeroRedundancyOptimizer's state (efdl/_shards.py, issue #35):
which snapshot the new ranks agree on, where each new rank's model and parameters come from,
and the order of the transfers - without processes. The end-to-end cases are in
test_state_sharded.py."""

import ctypes

import pytest
import torch

from efdl import _shards
from efdl._shards import Fetch, Offer


def offers(seq, step, world, owned, source, ranks):
    """The offers of the old shards `ranks` of one commit."""
    return [Offer(seq, step, r, world, source, tuple(owned[r])) for r in ranks]


# An old world of 3 ranks owning 7 parameters (as ZeRO's greedy partition does: largest first).
OLD = {0: [0, 5], 1: [1, 4], 2: [2, 3, 6]}


def test_decide_takes_the_newest_snapshot_whose_old_shards_are_all_somewhere():
    # Node 2 is lost: seq 9 of old rank 2 is nowhere; seq 8 of it is in storage (read by rank 1).
    # Seq 7 is complete too, but older.
    by_rank = [offers(9, 9, 3, OLD, "memory", [0]) + offers(8, 8, 3, OLD, "memory", [0]),
               offers(9, 9, 3, OLD, "memory", [1]) + offers(8, 8, 3, OLD, "memory", [1])
               + offers(8, 8, 3, OLD, "storage", [0, 2]) + offers(7, 7, 3, OLD, "storage",
                                                                  [0, 1, 2])]
    d = _shards.decide(by_rank)
    assert d.key == (8, 8) and d.old_world == 3
    assert d.skipped == ((9, 9), [2])
    assert d.owned == OLD
    # memory before storage: old shard 0 is in rank 0's memory and in storage rank 1 reads
    assert d.holders == {0: [(0, "memory"), (1, "storage")], 1: [(1, "memory")],
                         2: [(1, "storage")]}


def test_decide_without_offers_is_a_fresh_start_and_without_a_complete_one_an_error():
    assert _shards.decide([[], []]) is None
    by_rank = [offers(9, 9, 3, OLD, "memory", [0]), offers(9, 9, 3, OLD, "memory", [1])]
    with pytest.raises(_shards.ShardsMissingError) as e:
        _shards.decide(by_rank)
    assert str(e.value) == ("the newest sharded snapshot (seq 9, step 9, written by 3 ranks) "
                            "lacks the optimizer shard of old rank(s) 2: in no surviving rank's "
                            "memory and in no snapshot store a rank can read, and no older "
                            "snapshot is complete")


def test_decide_never_mixes_shards_of_different_worlds_under_one_key():
    two = {0: [0, 2, 4, 6], 1: [1, 3, 5]}
    by_rank = [offers(5, 5, 3, OLD, "memory", [0, 1]), offers(5, 5, 2, two, "memory", [1])]
    with pytest.raises(_shards.ShardsMissingError):
        _shards.decide(by_rank)   # old rank 2 of the 3-rank world is missing


def test_base_of_prefers_memory_on_the_node_then_another_rank_s_memory_then_storage():
    d = _shards.Decision((8, 8), 3, OLD,
                         {0: [(0, "memory"), (1, "storage")], 1: [(1, "memory")],
                          2: [(1, "storage")]}, None)
    bases = _shards.base_of(d, 4)
    assert bases[0] == (0, 0, "memory")      # its own old shard
    assert bases[1] == (1, 1, "memory")
    # ranks 2 and 3 hold nothing: a shard in another rank's memory (not old shard 2, only in
    # storage), the senders spread by load
    assert bases[2] == (0, 0, "memory")
    assert bases[3] == (1, 1, "memory")
    # with no memory anywhere: storage, read by the rank itself when it can
    d = _shards.Decision((8, 8), 2, {0: [0], 1: [1]},
                         {0: [(0, "storage"), (1, "storage")], 1: [(0, "storage")]}, None)
    assert _shards.base_of(d, 3) == {0: (0, 0, "storage"), 1: (0, 1, "storage"),
                                     2: (0, 0, "storage")}


def test_a_shard_in_a_rank_s_memory_is_sent_rather_than_read_from_storage():
    d = _shards.Decision((8, 8), 1, {0: [0, 1, 2]}, {0: [(1, "memory"), (0, "storage")]}, None)
    assert _shards.base_of(d, 3)[2] == (0, 1, "memory")
    plan = _shards.plan(d, [[0], [1], [2]])
    assert plan[2] == [Fetch(0, 1, "memory", [2])]
    # rank 0 reads storage itself only when no rank has the shard in memory
    assert plan[0] == [Fetch(0, 1, "memory", [0])]


def test_a_rank_that_holds_an_old_shard_reads_it_itself():
    d = _shards.Decision((8, 8), 1, {0: [0, 1]}, {0: [(0, "memory"), (1, "memory")]}, None)
    assert _shards.plan(d, [[], [0, 1]]) == {0: [], 1: [Fetch(0, 1, "memory", [0, 1])]}
    assert _shards.transfers(_shards.plan(d, [[], [0, 1]])) == []


def test_plan_maps_every_new_parameter_to_its_old_shard_once():
    d = _shards.Decision((8, 8), 3, OLD,
                         {0: [(0, "memory")], 1: [(1, "memory")], 2: [(0, "storage"),
                                                                      (1, "storage")]}, None)
    new = [[0, 2, 4], [1, 3, 5, 6]]   # the new world of 2 owns them so
    plan = _shards.plan(d, new)
    assert plan[0] == [Fetch(0, 0, "memory", [0]), Fetch(1, 1, "memory", [4]),
                       Fetch(2, 0, "storage", [2])]
    assert plan[1] == [Fetch(0, 0, "memory", [5]), Fetch(1, 1, "memory", [1]),
                       Fetch(2, 1, "storage", [3, 6])]
    for n, fetches in plan.items():
        assert sorted(i for f in fetches for i in f.indices) == new[n]
    # only what a rank does not read itself crosses the network, in one order for every rank
    assert _shards.transfers(plan) == [(0, Fetch(1, 1, "memory", [4])),
                                       (1, Fetch(0, 0, "memory", [5]))]


def test_plan_spreads_a_shard_held_twice_by_load_and_never_gathers_it_on_one_rank():
    d = _shards.Decision((3, 3), 1, {0: list(range(8))},
                         {0: [(0, "memory"), (1, "memory")]}, None)
    new = [[0, 4], [1, 5], [2, 6], [3, 7]]
    plan = _shards.plan(d, new)
    assert plan[0] == [Fetch(0, 0, "memory", [0, 4])]
    assert plan[1] == [Fetch(0, 1, "memory", [1, 5])]
    # ranks 2 and 3 read nothing themselves: the two holders send one each
    assert {plan[2][0].src, plan[3][0].src} == {0, 1}
    assert [f.indices for f in (plan[2][0], plan[3][0])] == [[2, 6], [3, 7]]


def test_plan_refuses_a_parameter_no_old_shard_has():
    d = _shards.Decision((3, 3), 1, {0: [0, 1]}, {0: [(0, "memory")]}, None)
    with pytest.raises(_shards.ShardsMissingError) as e:
        _shards.plan(d, [[0, 1, 2]])
    assert "parameter 2 of the optimizer is in no old shard of snapshot seq 3" in str(e.value)


def test_optimizer_names_select_the_state_of_given_parameters():
    entries = [("model/w", "float32", [2], 8), ("optimizer/1/exp_avg", "float32", [2], 8),
               ("optimizer/10/exp_avg", "float32", [2], 8), ("optimizer/1/step", "float32", [], 4),
               ("kw/x", "float32", [1], 4)]
    assert _shards.optimizer_names(entries, [1]) == {"optimizer/1/exp_avg", "optimizer/1/step"}
    assert _shards.not_optimizer(entries) == {"model/w", "kw/x"}


class Piece:
    def __init__(self, tensors):
        self.tensors = [(n, "float32", [t.numel()], t.numel() * 4) for n, t in tensors]
        self.data = [t for _, t in tensors]


def read(piece, ptrs):
    for t, p in zip(piece.data, ptrs):
        if p:
            ctypes.memmove(p, t.data_ptr(), t.numel() * 4)


def test_a_composed_snapshot_reads_each_tensor_from_the_piece_that_holds_it():
    a = Piece([("optimizer/0/exp_avg", torch.tensor([1.0, 2.0])),
               ("optimizer/5/exp_avg", torch.tensor([9.0]))])
    b = Piece([("optimizer/4/exp_avg", torch.tensor([3.0, 4.0, 5.0]))])
    composed = _shards.ComposedSnapshot(8, 8, [(read, a, {"optimizer/0/exp_avg"}),
                                               (read, b, {"optimizer/4/exp_avg"})], "{}", "x")
    assert [e[0] for e in composed.tensors] == ["optimizer/0/exp_avg", "optimizer/4/exp_avg"]
    out0, out4 = torch.zeros(2), torch.zeros(3)
    composed.restore([out0.data_ptr(), out4.data_ptr()])
    assert out0.tolist() == [1.0, 2.0] and out4.tolist() == [3.0, 4.0, 5.0]


def test_the_restore_log_names_each_source():
    assert _shards.describe(Fetch(2, 1, "storage", [3]), 1, "/s/job/rank-2/x") == \
        "old shard 2 from storage (/s/job/rank-2/x)"
    assert _shards.describe(Fetch(0, 1, "memory", [3]), 1, "") == \
        "old shard 0 from this node's memory"
    assert _shards.describe(Fetch(0, 0, "memory", [3]), 2, "") == \
        "old shard 0 from rank 0 over the network (from its node's memory)"


# -- a node's peer copy (issue #35 part 2) --------------------------------------------------------

def test_a_lost_host_s_shard_comes_from_a_peer_copy_before_storage():
    # Host of old rank 2 lost: its shard is in rank 0's node's peer copy and in storage (rank 1
    # reads it); seq 9 is complete through the peer copy, so nothing is lost.
    by_rank = [offers(9, 9, 3, OLD, "memory", [0]) + offers(9, 9, 3, OLD, "peer_copy", [2]),
               offers(9, 9, 3, OLD, "memory", [1]) + offers(8, 8, 3, OLD, "storage", [0, 1, 2])
               + offers(9, 9, 3, OLD, "storage", [2])]
    d = _shards.decide(by_rank)
    assert d.key == (9, 9) and d.skipped is None
    assert d.holders[2] == [(0, "peer_copy"), (1, "storage")]
    plan = _shards.plan(d, [[0, 2, 4, 6], [1, 3, 5]])
    # new rank 0 reads old shard 2 from its node's peer copy; new rank 1 receives its part of
    # it from rank 0 rather than reading storage itself
    assert Fetch(2, 0, "peer_copy", [2, 6]) in plan[0]
    assert Fetch(2, 0, "peer_copy", [3]) in plan[1]


def test_memory_comes_before_a_peer_copy_and_a_peer_copy_before_storage():
    d = _shards.decide([offers(5, 5, 1, {0: [0, 1]}, "storage", [0]),
                        offers(5, 5, 1, {0: [0, 1]}, "peer_copy", [0]),
                        offers(5, 5, 1, {0: [0, 1]}, "memory", [0])])
    assert d.holders[0] == [(2, "memory"), (1, "peer_copy"), (0, "storage")]
    assert _shards.plan(d, [[0], [1], []]) == {0: [Fetch(0, 2, "memory", [0])],
                                               1: [Fetch(0, 2, "memory", [1])], 2: []}
    only_copy = _shards.Decision((5, 5), 1, {0: [0, 1]},
                                 {0: [(1, "peer_copy"), (0, "storage")]}, None)
    assert _shards.base_of(only_copy, 2) == {0: (0, 1, "peer_copy"), 1: (0, 1, "peer_copy")}
    assert _shards.plan(only_copy, [[0], [1]]) == {0: [Fetch(0, 1, "peer_copy", [0])],
                                                   1: [Fetch(0, 1, "peer_copy", [1])]}


def test_the_restore_log_names_a_peer_copy():
    assert _shards.describe(Fetch(2, 1, "peer_copy", [3]), 1, "") == \
        "old shard 2 from this node's peer copy"
    assert _shards.describe(Fetch(2, 1, "peer_copy", [3]), 0, "") == \
        "old shard 2 from rank 1 over the network (from its node's peer copy)"


def test_a_node_s_peer_copies_are_found_by_their_arena_names(tmp_path):
    from efdl import _efdl
    for scope in ("rank1", "rank12", "node"):
        open(_efdl.arena_path(str(tmp_path), "job", "h.0", scope), "w").close()
    for scope in ("rank3", "rank7"):
        open(_efdl.arena_path(str(tmp_path), "job", "h.0", _efdl.peer_arena_scope(scope)),
             "w").close()
    open(_efdl.arena_path(str(tmp_path), "job", "h.1", _efdl.peer_arena_scope("rank5")),
         "w").close()
    assert _shards.readable_peer_copies(str(tmp_path), "job", "h.0") == [3, 7]
    # a node's own arenas are not its peer copies, nor the other way round
    assert _shards.readable_scopes(str(tmp_path), "job", "h.0", str(tmp_path / "none")) == [1, 12]
