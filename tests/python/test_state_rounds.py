"""State's in-process rounds as a collaborator (efdl/_rounds.py) and its samplers as a part
(efdl/_parts.py, SamplerPart), in one process: what the split must keep (#31).

The rounds across real rounds are tested end to end in test_e2e_elastic_run.py and
test_e2e_horovod.py.
"""

import gc
import os
import weakref

import pytest
import torch

from efdl.backend.horovod.torch import elastic
from efdl.state import State


@pytest.fixture
def job(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EFDL_CONTROL_SOCKET",
                "EFDL_AGENT_PERSISTS", "EFDL_SNAPSHOT_PER_RANK", "EFDL_ROUND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EFDL_JOB_ID", "rounds-" + tmp_path.name)
    monkeypatch.setenv("EFDL_SNAPSHOT_DIR", str(tmp_path / "snaps"))
    monkeypatch.setenv("EFDL_SHM_DIR", str(tmp_path / "shm"))
    os.makedirs(tmp_path / "shm")


@pytest.mark.parametrize("kind", [State, elastic.TorchState])
def test_a_state_is_freed_as_soon_as_the_program_drops_it(job, kind):
    # Its __del__ persists the newest commit (the usual `state` local of a main() that returns):
    # the rounds collaborator must not hold its State in a reference cycle, which only the
    # garbage collector would break, later or never.
    state = kind(torch.nn.Linear(2, 2), epoch=0)
    state.commit()
    ref = weakref.ref(state)
    gc.disable()
    try:
        del state
        assert ref() is None, "a reference cycle keeps the State alive"
    finally:
        gc.enable()


def test_torch_state_save_and_restore_take_the_sampler_back_to_the_saved_record(job):
    sampler = elastic.ElasticSampler(list(range(20)), shuffle=False)
    model = torch.nn.Linear(2, 2)
    state = elastic.TorchState(model, None, train_sampler=sampler, epoch=3, batch=0)
    assert state.train_sampler is sampler and len(sampler) == 20
    sampler.epoch = 5
    sampler.record_batch(0, 4)
    state.batch = 1
    state.save()
    saved_weight = model.weight.detach().clone()
    sampler.record_batch(1, 4)
    sampler.epoch = 9
    state.batch = 2
    with torch.no_grad():
        model.weight.add_(1.0)
    state.restore()
    assert state.batch == 1 and state.epoch == 3
    assert sorted(sampler.processed.nonzero().flatten().tolist()) == [0, 1, 2, 3]
    assert sampler.epoch == 5 and len(sampler) == 16, "the rest of the epoch is dealt again"
    assert torch.equal(model.weight, saved_weight)
    state.check_host_updates()   # no agent asked to stop: nothing happens
    assert state.batch == 1


def test_a_plain_state_keeps_no_samplers_and_its_values_as_given(job):
    sampler = elastic.ElasticSampler(list(range(6)), shuffle=False)
    state = State(None, epoch=0)
    state.commit()
    assert sorted(state.__dict__["_values"]) == ["epoch"]
    tstate = elastic.TorchState(None, train_sampler=sampler, epoch=0)
    assert sorted(tstate.__dict__["_values"]) == [
        "efdl_sampler_train_sampler_epoch", "efdl_sampler_train_sampler_processed", "epoch"]
