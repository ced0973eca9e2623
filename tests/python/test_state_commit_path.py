"""efdl.State's per-commit fast path: what it caches between commits (the tensor list, the
pickled optimizer metadata) must be dropped whenever what it was built from changes, and the
keyword arguments it writes as JSON must come back exactly. Each test commits, changes one
thing, commits again and restores into fresh objects (from shared memory and from storage)."""

import math

import torch

from test_state import forget_memory, job, make_training, train_step  # noqa: F401 (fixture)

from efdl.state import State


def restore_both(job, build, check):  # noqa: F811 - job is the fixture's value
    """Runs check(restored State, objects) after restoring from memory, then from storage."""
    for source in ("memory", "storage"):
        if source == "storage":
            forget_memory(job)
        objects = build()
        restored = State(*objects[:2], **objects[2])
        assert restored.restored_from[0] == source
        check(restored, objects)


def test_in_place_update_of_a_non_contiguous_tensor_is_committed(job):  # noqa: F811
    buf = torch.zeros(4, 6).t()   # non-contiguous: committed through a staging copy
    assert not buf.is_contiguous()
    state = State(buf=buf, step=0)
    state.commit()
    buf.add_(3)
    state.step = 1
    state.commit()
    state.flush()
    restore_both(job, lambda: (None, None, {"buf": None, "step": 0}),
                 lambda r, _: torch.equal(r.buf, torch.full((6, 4), 3.0)) or
                 (_ for _ in ()).throw(AssertionError(r.buf)))


def test_changed_learning_rate_and_new_optimizer_state_are_committed(job):  # noqa: F811
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0)
    state.commit()                      # before the first step: no momentum buffers yet
    train_step(model, optimizer)
    state.step = 1
    state.commit()                      # momentum buffers appeared
    optimizer.param_groups[0]["lr"] = 0.025
    optimizer.param_groups[0]["momentum"] = 0.5
    train_step(model, optimizer)
    state.step = 2
    state.commit()                      # same tensors, changed hyper-parameters
    state.flush()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state[model[0].weight]["momentum_buffer"].clone()

    def check(restored, objects):
        m2, o2, _ = objects
        assert restored.step == 2
        assert (o2.param_groups[0]["lr"], o2.param_groups[0]["momentum"]) == (0.025, 0.5)
        assert torch.equal(o2.state[m2[0].weight]["momentum_buffer"], momentum)
        for k, v in m2.state_dict().items():
            assert torch.equal(v, weights[k]), k

    def build():
        m2, o2, _ = make_training(seed=1)
        return m2, o2, {"step": 0}
    restore_both(job, build, check)


def test_replaced_parameter_storage_is_committed_from_its_new_memory(job):  # noqa: F811
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0)
    train_step(model, optimizer)
    state.commit()
    with torch.no_grad():
        model[0].weight.data = torch.full_like(model[0].weight, 7.0)  # same object, new memory
    state.step = 1
    state.commit()
    state.flush()

    def check(restored, objects):
        assert restored.step == 1
        assert torch.equal(objects[0][0].weight, torch.full_like(objects[0][0].weight, 7.0))

    def build():
        m2, o2, _ = make_training(seed=1)
        return m2, o2, {"step": 0}
    restore_both(job, build, check)


def test_keyword_arguments_of_every_kind_come_back_exactly(job):  # noqa: F811
    values = {
        "step": 3, "big": 2 ** 70, "neg": -(2 ** 63), "ratio": 0.1, "tiny": 5e-324,
        "nan": float("nan"), "inf": float("-inf"), "flag": True, "none": None,
        "text": 'quote " backslash \\ newline \n unicode \u00e9\u4e2d', "pair": (1, 2),
        "items": [1, "a"], "table": {"k": 1}, "one": 1.0,
        "lone": "\ud800", "lone_in": ["\udfff"],  # lone surrogates: not valid JSON text
    }
    state = State(**values)
    state.commit()
    state.step = 4
    state.ratio = 0.2
    state.commit()
    state.flush()
    expected = dict(values, step=4, ratio=0.2)

    def check(restored, _):
        for k, v in expected.items():
            got = getattr(restored, k)
            assert type(got) is type(v), (k, got, v)
            assert got == v or (isinstance(v, float) and math.isnan(v) and math.isnan(got)), k
    restore_both(job, lambda: (None, None, {k: None for k in values}), check)
