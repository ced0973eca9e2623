"""hvd.elastic's pure parts (python/efdl/backend/horovod/torch/elastic.py): the ElasticSampler's
dealing and records, and TorchState's snapshot of a sampler and its reset callbacks, in one
process without an agent. End to end across a kill and a join: test_e2e_elastic_run.py."""

import os

import pytest
import torch
from torch.utils.data import TensorDataset

from efdl.backend.horovod.torch import elastic


@pytest.fixture
def world(monkeypatch):
    """Sets the (size, rank) the sampler deals for."""
    place = {"size": 1, "rank": 0}
    monkeypatch.setattr(elastic, "_size", lambda: place["size"])
    monkeypatch.setattr(elastic, "_rank", lambda: place["rank"])

    def set_place(size, rank):
        place.update(size=size, rank=rank)
    return set_place


def dataset(n=30):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))


def test_the_sampler_deals_the_epoch_evenly_and_records_every_ranks_batch(world):
    world(3, 1)
    s = elastic.ElasticSampler(dataset(), shuffle=True, seed=3)
    assert len(s) == 10 and len(list(s)) == 10
    shares = []
    for r in range(3):
        world(3, r)
        s.reset()
        shares.append(list(s))
    assert sorted(i for share in shares for i in share) == list(range(30)), "a partition"
    world(3, 1)
    s.reset()
    s.record_batch(0, 2)
    s.record_batch(1, 2)
    # Two batches of 2 samples on each of 3 ranks: 12 samples, this rank's and the others'.
    assert int(s.processed.sum()) == 12
    assert set(shares[0][:4]) | set(shares[1][:4]) | set(shares[2][:4]) == \
        set(s.processed.nonzero().flatten().tolist())


def test_after_a_reset_the_new_ranks_share_only_what_is_left(world):
    world(3, 0)
    s = elastic.ElasticSampler(dataset(), shuffle=False)
    s.record_batch(0, 4)                                   # 12 of 30 trained at size 3
    world(2, 1)
    s.reset()
    left = set(range(30)) - set(s.processed.nonzero().flatten().tolist())
    assert len(left) == 18 and len(s) == 9
    seen = set()
    for r in range(2):
        world(2, r)
        s.reset()
        seen |= set(s)
    assert seen == left


def test_set_epoch_starts_over_in_place_and_the_state_dict_round_trips(world):
    s = elastic.ElasticSampler(dataset(), shuffle=False)
    record = s.processed
    s.record_indices([1, 2, 3])
    sd = s.state_dict()
    assert sd == {"epoch": 0, "processed_indices": {1, 2, 3}}
    s.set_epoch(4)
    assert s.processed is record and int(record.sum()) == 0, "the same tensor, cleared"
    t = elastic.ElasticSampler(dataset(), shuffle=False)
    t.load_state_dict(sd)
    assert t.epoch == 0 and sorted(t.processed.nonzero().flatten().tolist()) == [1, 2, 3]
    assert len(t) == 27


@pytest.fixture
def job(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EFDL_CONTROL_SOCKET",
                "EFDL_AGENT_PERSISTS", "EFDL_SNAPSHOT_PER_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EFDL_JOB_ID", "hvd-elastic-" + tmp_path.name)
    monkeypatch.setenv("EFDL_SNAPSHOT_DIR", str(tmp_path / "snaps"))
    monkeypatch.setenv("EFDL_SHM_DIR", str(tmp_path / "shm"))
    os.makedirs(tmp_path / "shm")


def test_torch_state_snapshots_the_sampler_and_a_new_process_gets_it_back(job):
    model = torch.nn.Linear(1, 1)
    sampler = elastic.ElasticSampler(dataset(), shuffle=False)
    state = elastic.TorchState(model=model, optimizer=None, train_sampler=sampler, epoch=2,
                               batch=0)
    assert state.train_sampler is sampler
    sampler.record_batch(0, 5)
    state.batch = 1
    state.commit()
    state.flush()
    del state
    fresh = elastic.ElasticSampler(dataset(), shuffle=False)
    again = elastic.TorchState(model=torch.nn.Linear(1, 1), optimizer=None, train_sampler=fresh,
                               epoch=0, batch=0)
    assert (again.epoch, again.batch) == (2, 1)
    assert sorted(fresh.processed.nonzero().flatten().tolist()) == [0, 1, 2, 3, 4]
    assert len(fresh) == 25, "the restored record is dealt again"
    assert torch.equal(again.model.weight, model.weight)


def test_reset_callbacks_must_be_callables_and_run_in_order(job):
    state = elastic.TorchState(model=torch.nn.Linear(1, 1), epoch=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.register_reset_callbacks(lambda: calls.append(2))
    with pytest.raises(TypeError, match="callables"):
        state.register_reset_callbacks([3])
    state.on_reset()
    assert calls == [1, 2]
