"""What State unpickles from a snapshot's metadata: an allow-list (efdl/_unpickle.py).

A pickle planted in shared memory or storage must not run code in the worker that restores it;
a program's own class is refused at the commit that would store it, with the line that says how
to allow it (EFDL_UNPICKLE_ALLOW); allowed, it round-trips.
"""

import collections
import datetime
import fractions
import os
import pickle
import subprocess
import textwrap

import numpy as np
import pytest
import torch

from conftest import PYTHON, clean_environment

from efdl import _unpickle
from efdl.state import SnapshotError, State
from test_state import forget_memory, job, make_training, train_step  # noqa: F401 (fixture)

TIMEOUT = 120


class Weights:
    """A program's own class stored in State."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Weights) and other.value == self.value


def test_values_a_training_program_keeps_round_trip():
    value = {
        "ordered": collections.OrderedDict(a=1, b=[1.5, None]),
        "counts": collections.Counter("aab"), "queue": collections.deque([1, 2]),
        "by_default": collections.defaultdict(list, {"x": [1]}),
        "set": {1, 2}, "frozen": frozenset({"a"}), "complex": 1 + 2j, "raw": bytearray(b"ab"),
        "slice": slice(1, 5, 2), "range": range(3),
        "when": datetime.datetime(2026, 12, 4, 13, 0), "took": datetime.timedelta(seconds=5),
        "ratio": fractions.Fraction(1, 3),
        "dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "tensors": [torch.arange(4), torch.nn.Parameter(torch.ones(2))],
        "best": np.float64(0.93), "array": np.arange(5, dtype=np.int32), "kind": np.dtype("f4"),
    }
    back = _unpickle.loads(pickle.dumps(value, protocol=4))
    for key, v in value.items():
        if key == "tensors":
            assert all(torch.equal(a, b) for a, b in zip(back[key], v))
        elif key == "array":
            assert np.array_equal(back[key], v) and back[key].dtype == v.dtype
        else:
            assert back[key] == v and type(back[key]) is type(v), key


def test_a_planted_pickle_does_not_run_and_names_what_it_holds(tmp_path):
    marker = tmp_path / "ran"
    planted = pickle.dumps(Payload(str(marker)), protocol=4)
    with pytest.raises(_unpickle.RefusedType, match=r"posix\.system.*EFDL_UNPICKLE_ALLOW"):
        _unpickle.loads(planted)
    assert not marker.exists()
    # Headers sent between ranks hold plain values only: no global at all.
    with pytest.raises(_unpickle.RefusedType, match=r"builtins\.bytearray"):
        _unpickle.loads(pickle.dumps({"seq": 1, "x": bytearray(b"a")}, protocol=4),
                        allow_globals=False)
    assert _unpickle.loads(pickle.dumps({"seq": 1, "t": [("w", 4)]}, protocol=4),
                           allow_globals=False) == {"seq": 1, "t": [("w", 4)]}


class Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, ("touch " + self.path,))


def test_a_programs_own_class_fails_the_commit_and_is_restored_once_allowed(job, monkeypatch):
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0, weights=Weights(3))
    with pytest.raises(TypeError, match=r"State\.commit: .*test_state_unpickle\.Weights.*"
                                        r"EFDL_UNPICKLE_ALLOW=test_state_unpickle\.Weights"):
        state.commit()
    monkeypatch.setenv("EFDL_UNPICKLE_ALLOW", "test_state_unpickle.Weights")
    train_step(model, optimizer)
    state.step = 1
    assert state.commit()
    state.flush()
    forget_memory(job)
    m2, o2, _ = make_training(seed=1)
    back = State(m2, o2, step=0, weights=None)
    assert back.step == 1 and back.weights == Weights(3)
    monkeypatch.setenv("EFDL_UNPICKLE_ALLOW", "test_state_unpickle.*")
    assert State(step=0, weights=None).weights == Weights(3)


def test_a_snapshot_holding_a_refused_type_stops_the_restore_and_keeps_the_snapshots(
        job, tmp_path):
    """A snapshot written by a program that allowed its payload (left in memory and in storage)
    is refused by a restore that does not allow it: SnapshotError naming the type, nothing run,
    no fallback to an older snapshot or to the start, every file kept."""
    marker = tmp_path / "ran"
    writer = textwrap.dedent("""
        import os, sys
        from efdl.state import State

        class Payload:
            def __reduce__(self):
                return (os.system, ("touch " + sys.argv[1],))

        state = State(step=0, planted=None)
        state.step = 1
        state.commit()
        state.planted = Payload()
        state.step = 2
        state.commit()
        state.flush()
        os._exit(0)   # a crash: the arena stays in shared memory
    """)
    env = dict(clean_environment(), EFDL_JOB_ID=job["EFDL_JOB_ID"],
               EFDL_UNPICKLE_ALLOW="posix.system")
    subprocess.run([PYTHON, "-c", writer, str(marker)], env=env, check=True, timeout=TIMEOUT)
    assert not marker.exists()   # the commit-time check does not run an allowed global either
    shm = sorted(os.listdir(job["EFDL_SHM_DIR"]))
    snaps = os.path.join(job["EFDL_SNAPSHOT_DIR"], job["EFDL_JOB_ID"])
    files = sorted(os.listdir(snaps))
    assert shm and [f for f in files if f.startswith("snap-")]
    for source in ("memory", "storage"):
        if source == "storage":
            forget_memory(job)
        with pytest.raises(SnapshotError, match=r"snapshot seq 2 .*posix\.system.*"
                                                r"EFDL_UNPICKLE_ALLOW=posix\.system"):
            State(step=0, planted=None)
        assert not marker.exists(), source
        if source == "memory":
            assert sorted(os.listdir(job["EFDL_SHM_DIR"])) == shm
    assert sorted(os.listdir(snaps)) == files
