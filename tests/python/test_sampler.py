"""efdl.data.DistributedSampler against torch's sampler, and its resume point."""

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

from efdl.data import DistributedSampler


def torch_indices(n, world, rank, shuffle, seed, drop_last, epoch):
    sampler = TorchSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def cases():
    rng = random.Random(1234)
    sizes = [0, 1, 2, 3, 5, 7, 8, 10, 16, 31, 64, 97]
    for n, world, shuffle, drop_last in itertools.product(sizes, [1, 2, 3, 4, 7, 12],
                                                          [True, False], [True, False]):
        yield n, world, shuffle, rng.randrange(100), drop_last, rng.randrange(5)


def test_start_index_zero_yields_exactly_torchs_sampler():
    checked = 0
    for n, world, shuffle, seed, drop_last, epoch in cases():
        for rank in range(world):
            ours = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                      seed=seed, drop_last=drop_last, epoch=epoch)
            expected = torch_indices(n, world, rank, shuffle, seed, drop_last, epoch)
            assert list(ours) == expected, (n, world, rank, shuffle, seed, drop_last, epoch)
            assert len(ours) == len(expected)
            checked += 1
    assert checked > 1000


def test_set_epoch_then_iterate_matches_torch():
    ours = DistributedSampler(range(50), num_replicas=3, rank=1, seed=7)
    for epoch in range(4):
        ours.set_epoch(epoch)
        assert list(ours) == torch_indices(50, 3, 1, True, 7, False, epoch)


def test_per_rank_start_index_skips_that_many_of_this_ranks_samples():
    for n, world, shuffle, seed, drop_last, epoch in cases():
        for rank in range(world):
            full = torch_indices(n, world, rank, shuffle, seed, drop_last, epoch)
            for start in sorted({0, 1, len(full) // 2, max(len(full) - 1, 0), len(full),
                                 len(full) + 3}):
                ours = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last,
                                          epoch=epoch, start_index=start)
                assert len(ours) == len(full[start:])
                assert list(ours) == full[start:], (n, world, rank, start)


def test_global_start_index_is_start_index_times_world_size():
    a = DistributedSampler(range(40), num_replicas=3, rank=2, start_index=4, seed=3)
    b = DistributedSampler(range(40), num_replicas=3, rank=2, global_start_index=12, seed=3)
    assert a.global_start_index == 12 and b.start_index == 4
    assert list(a) == list(b)


def test_global_start_deals_the_rest_of_the_epoch_order_to_the_new_world():
    n, seed, epoch = 101, 9, 3
    order = DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed,
                               epoch=epoch).epoch_order()
    for world, start, drop_last in itertools.product([1, 2, 3, 5, 8], [0, 1, 17, 50, 100, 101],
                                                     [False, True]):
        got = [DistributedSampler(range(n), num_replicas=world, rank=r, seed=seed, epoch=epoch,
                                  drop_last=drop_last, global_start_index=start)
               for r in range(world)]
        lengths = {len(s) for s in got}
        assert len(lengths) == 1, "every rank must get the same number of samples"
        lists = [list(s) for s in got]
        seen = set(itertools.chain.from_iterable(lists))
        rest = order[start:]
        if drop_last:
            kept = len(rest) - len(rest) % world
            assert sorted(seen) == sorted(rest[:kept])
            assert sum(map(len, lists)) == kept
        else:
            padding = sum(map(len, lists)) - len(rest)
            assert set(rest) <= seen and 0 <= padding < world
            if padding == 0:
                assert not seen & set(order[:start]), "consumed samples came back"


def test_update_of_world_size_keeps_the_global_resume_point():
    sampler = DistributedSampler(range(60), num_replicas=4, rank=3, start_index=5, seed=1)
    sampler.update(num_replicas=3, rank=0)
    assert sampler.global_start_index == 20
    sampler.update(start_index=2, num_replicas=2, rank=1, epoch=4)
    assert (sampler.global_start_index, sampler.epoch, sampler.rank) == (4, 4, 1)
    assert list(sampler) == torch_indices(60, 2, 1, True, 1, False, 4)[2:]


def test_set_epoch_keeps_skip_for_same_epoch_and_drops_it_for_a_new_one():
    sampler = DistributedSampler(range(30), num_replicas=2, rank=0, epoch=5, start_index=10)
    sampler.set_epoch(5)
    assert len(sampler) == 5
    sampler.set_epoch(6)
    assert len(sampler) == 15 and list(sampler) == torch_indices(30, 2, 0, True, 0, False, 6)


def test_a_finished_pass_makes_the_next_pass_whole():
    sampler = DistributedSampler(range(30), num_replicas=2, rank=1, shuffle=False, start_index=12)
    assert list(sampler) == [25, 27, 29]
    assert list(sampler) == list(range(1, 30, 2))
    partial = DistributedSampler(range(30), num_replicas=2, rank=1, shuffle=False, start_index=12)
    next(iter(partial))  # an abandoned pass keeps the resume point
    assert len(partial) == 3
    moved = DistributedSampler(range(30), num_replicas=2, rank=1, shuffle=False, start_index=12)
    fixed = iter(moved)
    moved.update(start_index=14)  # the pass already started keeps its indices...
    assert list(fixed) == [25, 27, 29]
    assert list(moved) == [29]  # ...and the moved resume point survives its end


def test_defaults_come_from_the_launcher_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    sampler = DistributedSampler(range(20))
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    sampler = DistributedSampler(range(20))
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (1, 0, 20)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_replicas=2, rank=2), "rank=2 must be below num_replicas=2"),
    (dict(num_replicas=0, rank=0), "num_replicas=0"),
    (dict(num_replicas=2, rank=0, start_index=-1), "start_index=-1"),
    (dict(num_replicas=2, rank=0, start_index=1.5), "start_index=1.5"),
    (dict(num_replicas=2, rank=0, epoch=-1), "epoch=-1"),
])
def test_bad_arguments_get_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        DistributedSampler(range(10), **kwargs)


def test_both_kinds_of_start_are_rejected():
    sampler = DistributedSampler(range(10), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="not both"):
        sampler.update(start_index=1, global_start_index=2)
    with pytest.raises(ValueError, match="not both"):
        DistributedSampler(range(10), num_replicas=1, rank=0, start_index=1,
                           global_start_index=2)


def test_dataloader_resumes_from_the_spec_start_index():
    batch_size, world, rank, step = 4, 3, 1, 2
    dataset = TensorDataset(torch.arange(50))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, epoch=1,
                                 start_index=step * batch_size)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    full = torch_indices(50, world, rank, True, 0, False, 1)
    assert len(loader) == -(-(len(full) - step * batch_size) // batch_size)
    got = [int(x) for (batch,) in loader for x in batch]
    assert got == full[step * batch_size:]
