"""efdl.State's compiled commit path (efdl._efdl.FastCommit, src/python/fast_commit.h).

After a commit by the Python path, State hands the plan to FastCommit, which repeats the commit
from C++ while nothing it was made from changed. Each test here gets the compiled path going
(it must have taken commits), changes one thing, commits, and restores into fresh objects from
shared memory and from storage: the change must be in the snapshot, and the compiled path must
have noticed it itself (a miss), not left it to luck."""

import gc
import glob
import json
import weakref

import pytest
import torch

from test_state import job, make_training, train_step  # noqa: F401 (fixture)
from test_state_commit_path import restore_both

from efdl.state import State

import cluster  # tests/python/workers, on sys.path from conftest.py


def hot(state, model, optimizer, commits=3):
    """Trains and commits until the compiled path has taken commits; returns it."""
    for _ in range(commits):
        train_step(model, optimizer)
        state.step += 1
        state.commit()
    fast = state._fast
    assert fast is not None and fast.hits >= commits - 2, "the compiled path did not start"
    return fast


def committed_after(state, model, optimizer, fast):
    """Commits once more and checks that `fast` itself declined (saw the change)."""
    misses = fast.misses
    state.step += 1
    state.commit()
    state.flush()
    assert fast.misses == misses + 1, "the compiled path copied a changed state"


def build_default():
    m2, o2, _ = make_training(seed=1)
    return m2, o2, {"step": 0}


def test_unchanged_state_is_committed_by_the_compiled_path(job):  # noqa: F811
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0, loss=0.5)
    fast = hot(state, model, optimizer, commits=5)
    state.loss = 0.25
    train_step(model, optimizer)
    state.step += 1
    state.commit()
    assert fast.hits == 5 and fast.misses == 0  # plain values changing is not a change of plan
    state.flush()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state[model[0].weight]["momentum_buffer"].clone()

    def check(restored, objects):
        m2, o2, _ = objects
        assert (restored.step, restored.loss) == (6, 0.25)
        for k, v in m2.state_dict().items():
            assert torch.equal(v, weights[k]), k
        assert torch.equal(o2.state[m2[0].weight]["momentum_buffer"], momentum)
    restore_both(job, lambda: build_default()[:2] + ({"step": 0, "loss": None},), check)


def test_meta_text_equals_the_python_path_for_every_plain_value(job):  # noqa: F811
    values = {"step": 3, "neg": -(2 ** 63), "top": 2 ** 63 - 1, "ratio": 0.1, "tiny": 5e-324,
              "one": 1.0, "big": 1e300, "flag": False, "yes": True, "none": None, "empty": "",
              "text": 'quote " backslash \\ newline \n tab \t bell \x07 unicode \u00e9\u4e2d',
              "buf": torch.arange(4.0)}
    state = State(**values)
    state.commit()
    fast = state._fast
    assert fast is not None
    python_text = state._meta(state._plan.scalars, None)
    ours = json.loads(fast.meta_text(state.__dict__))
    theirs = json.loads(python_text)
    assert ours == theirs
    for k, v in theirs["kwargs"].items():
        assert type(ours["kwargs"][k]) is type(v), k  # 1.0 stays a float, True a bool
    assert '"one":1.0' in fast.meta_text(state.__dict__)
    # Both paths write the text through one writer (src/python/meta_text.h): the same bytes.
    assert fast.meta_text(state.__dict__) == python_text


def reference_kwargs_json(values, pickled=()):
    """The "kwargs" text as the snapshots of earlier versions wrote it (Python's json.dumps for
    strings, repr for floats; the display form of the keys in `pickled`): the format the one
    writer must keep."""
    parts = []
    for k, v in values.items():
        if k in pickled:
            text = "<display>"
        elif type(v) is int:
            text = str(v)
        elif type(v) is float:
            text = repr(v)
        elif type(v) is bool:
            text = "true" if v else "false"
        elif v is None:
            text = "null"
        elif type(v) is str:
            text = json.dumps(v)
        elif isinstance(v, torch.Tensor):
            continue
        else:
            raise AssertionError("not a plain value: %r" % (v,))
        parts.append(json.dumps(str(k)) + ":" + text)
    return "{" + ",".join(parts) + "}"


def test_the_meta_writer_keeps_the_format_of_python_s_json_dumps():
    from efdl import _efdl

    class Sub(int):
        pass

    exact = {"step": 3, "neg": -(2 ** 63), "top": 2 ** 63 - 1, "ratio": 0.1, "big": 1e300,
             "one": 1.0, "flag": False, "none": None, "ascii": "plain",
             "controls": "\x00\x07\b\f\n\r\t\x1f\x7f \\ \"",
             "latin": "caf\u00e9", "cjk": "\u4e2d\u6587", "astral": "\U0001f600",
             "k\u00e9y \"quoted\"": 1, "buf": torch.arange(2.0)}
    text, rest = _efdl.meta_kwargs(exact, torch.Tensor, lambda v: "<display>")
    assert rest is None
    assert text == reference_kwargs_json(exact)
    pickled = {"huge": 2 ** 63, "nan": float("nan"), "inf": float("inf"), "tuple": (1, 2),
               "lone": "\ud800", "sub": Sub(1), "list": [1]}
    text, rest = _efdl.meta_kwargs(dict(exact, **pickled), torch.Tensor, lambda v: "<display>")
    assert rest == pickled or set(rest) == set(pickled)   # nan != nan
    assert text == reference_kwargs_json(dict(exact, **pickled), pickled)
    assert _efdl.program_field("") == ""
    assert _efdl.program_field("tr\u00e4in \udcff.py") == ',"program":%s' % json.dumps(
        "tr\u00e4in \udcff.py")
    assert _efdl.meta_text('{"a":1}', "UElDS0xF", ',"program":"p.py"') == (
        '{"kwargs":{"a":1},"kwargs_exact":true,"pickle":"UElDS0xF","program":"p.py"}')


@pytest.mark.parametrize("value", [2 ** 63, float("nan"), float("inf"), (1, 2), [1], {"k": 1},
                                   "\ud800", ["\ud800"]])
def test_values_only_pickle_carries_send_the_commit_to_the_python_path(job, value):  # noqa: F811
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0, extra=0)
    fast = hot(state, model, optimizer)
    state.extra = value
    committed_after(state, model, optimizer, fast)

    def check(restored, _):
        got = restored.extra
        assert type(got) is type(value)
        assert got == value or got != got  # nan
    restore_both(job, lambda: build_default()[:2] + ({"step": 0, "extra": None},), check)


def change_lr(model, optimizer, state):
    optimizer.param_groups[0]["lr"] = 0.025
    return lambda r, objs: objs[1].param_groups[0]["lr"] == 0.025


def change_parameter_memory(model, optimizer, state):
    with torch.no_grad():
        model[0].weight.data = torch.full_like(model[0].weight, 7.0)  # same object, new memory
    return lambda r, objs: torch.equal(objs[0][0].weight, torch.full_like(objs[0][0].weight, 7.0))


def change_parameter_storage_with_set(model, optimizer, state):
    with torch.no_grad():
        model[2].bias.set_(torch.full((3,), 2.0))
    return lambda r, objs: torch.equal(objs[0][2].bias, torch.full((3,), 2.0))


def change_momentum_object(model, optimizer, state):
    st = optimizer.state[model[0].weight]
    st["momentum_buffer"] = torch.full_like(st["momentum_buffer"], 5.0)
    return lambda r, objs: torch.equal(objs[1].state[objs[0][0].weight]["momentum_buffer"],
                                       torch.full_like(objs[0][0].weight, 5.0))


def change_optimizer_by_load_state_dict(model, optimizer, state):
    sd = optimizer.state_dict()
    for s in sd["state"].values():
        s["momentum_buffer"] = torch.full_like(s["momentum_buffer"], 3.0)
    optimizer.load_state_dict(sd)
    return lambda r, objs: all(torch.equal(s["momentum_buffer"],
                                           torch.full_like(s["momentum_buffer"], 3.0))
                               for s in objs[1].state.values())


def change_optimizer_object(model, optimizer, state):
    state.optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    train_step(model, state.optimizer)
    return lambda r, objs: objs[1].param_groups[0]["lr"] == 0.3


def change_keyword_tensor(model, optimizer, state):
    state.ema = torch.ones(3)
    return lambda r, objs: torch.equal(r.ema, torch.ones(3))


@pytest.mark.parametrize("change", [
    change_lr, change_parameter_memory, change_parameter_storage_with_set, change_momentum_object,
    change_optimizer_by_load_state_dict, change_optimizer_object, change_keyword_tensor])
def test_a_change_is_seen_by_the_compiled_path_and_committed(job, change):  # noqa: F811
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0, ema=torch.zeros(3))
    fast = hot(state, model, optimizer)
    check = change(model, optimizer, state)
    committed_after(state, model, optimizer, fast)
    assert state._fast is not None and state._fast is not fast  # made again from the new plan

    def build():
        m2, o2, _ = make_training(seed=1)
        return m2, o2, {"step": 0, "ema": None}

    def verify(restored, objects):
        assert restored.step == 4
        assert check(restored, objects)
    restore_both(job, build, verify)


def test_an_added_parameter_group_is_seen(job):  # noqa: F811
    def build(seed):
        model, _, _ = make_training(seed=seed)
        optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
        return model, optimizer
    model, optimizer = build(0)
    state = State(model, optimizer, step=0)
    fast = hot(state, model, optimizer)
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})
    committed_after(state, model, optimizer, fast)

    def build_restore():
        m2, o2 = build(1)
        o2.add_param_group({"params": list(m2[2].parameters()), "lr": 0.7})
        return m2, o2, {"step": 0}
    restore_both(job, build_restore,
                 lambda r, objs: objs[1].param_groups[1]["lr"] == 0.5 or pytest.fail("lr"))


def test_a_learning_rate_set_on_every_step_pauses_the_compiled_path(job):  # noqa: F811
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0)
    for i in range(12):
        optimizer.param_groups[0]["lr"] = 0.1 / (i + 1)
        train_step(model, optimizer)
        state.step += 1
        state.commit()
    assert state._fast is None and state._fast_retry > state._commits
    for _ in range(100):  # hyper-parameters settle: after the pause it comes back
        state.step += 1
        state.commit()
    assert state._fast is not None and state._fast.hits > 0
    state.flush()
    restore_both(job, build_default,
                 lambda r, objs: objs[1].param_groups[0]["lr"] == pytest.approx(0.1 / 12)
                 or pytest.fail("lr"))


def test_efdl_fast_commit_0_keeps_the_python_path(job, monkeypatch):  # noqa: F811
    monkeypatch.setenv("EFDL_FAST_COMMIT", "0")
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0)
    for _ in range(3):
        train_step(model, optimizer)
        state.step += 1
        state.commit()
    assert state._fast is None
    state.flush()
    restore_both(job, build_default, lambda r, objs: r.step == 3 or pytest.fail("step"))


def test_no_compiled_path_with_a_scheduler(job):  # noqa: F811
    model, optimizer, scheduler = make_training()
    state = State(model, optimizer, scheduler, step=0)
    for _ in range(3):
        train_step(model, optimizer, scheduler)
        state.step += 1
        state.commit()
    assert state._fast is None


def persister_threads():
    names = []
    for task in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(task) as f:
                names.append(f.read().strip())
        except OSError:
            pass  # a thread that ended meanwhile
    return names.count("efdl-persist")


def persister_threads_become(n):
    # The thread names itself once it runs: on a loaded machine that may come a little later.
    return cluster.poll_until(lambda: persister_threads() == n, 10, 0.01) is True


def test_a_dropped_state_is_freed_with_its_engine(job):  # noqa: F811
    # The compiled path must not keep State's __dict__ (and so the engine and its persister
    # thread) alive in a reference cycle the collector cannot see.
    before = persister_threads()

    def run():
        model, optimizer, _ = make_training()
        state = State(model, optimizer, step=0)
        hot(state, model, optimizer)
        assert persister_threads_become(before + 1)
        return weakref.ref(state)
    ref = run()
    gc.collect()
    assert ref() is None
    assert persister_threads_become(before)

