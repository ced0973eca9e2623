"""Progress reports from a worker to its agent, and the stack dump on a hang (issue #32).

Each State.commit() reports progress (one store into the node's progress board, shared memory
the agent maps: src/health/progress_board.h owns its layout, src/common/env_names.h the names of
its variables); a program without State calls efdl.progress(). Under `efdl run`, a rank whose reports stop for the
hang timeout is declared hung: its agent writes every local worker's Python stack (faulthandler,
armed here on the signal the agent names) and ends the rank that caused it (docs/operations.md,
"Hangs"). Outside `efdl run` every function here does nothing.
"""

import contextlib
import os

from efdl._names import Env

_board = {"key": None, "slot": None}   # the cached writer, keyed by (board path, slot)
_armed = {"pid": None, "file": None}
# Samples this process' EFDL samplers handed out (-1: none iterated yet): reported with each
# progress call, so that the agent can tell the samples per step (the goodput ledger's samples
# trained again). A fork (a pre-started worker) starts from its parent's count: only growth counts.
_drawn = [-1]


def counted(indices):
    """Yields a sampler's indices, counting them (efdl.data.DistributedSampler, ElasticSampler)."""
    if _drawn[0] < 0:
        _drawn[0] = 0
    for i in indices:
        _drawn[0] += 1
        yield i


def _slot():
    """The ProgressSlot writer of this worker, or None outside `efdl run` (or without a board)."""
    path = os.environ.get(Env.PROGRESS_BOARD)
    if not path:
        return None
    key = (path, os.environ.get(Env.PROGRESS_SLOT))
    if _board["key"] != key:
        _board["key"] = key
        _board["slot"] = None
        try:
            from efdl import _efdl
            _board["slot"] = _efdl.ProgressSlot(path, int(key[1]))
        except (ImportError, ValueError, TypeError, RuntimeError):
            _board["slot"] = None   # no board (detection off) or no _efdl: no reports
    return _board["slot"]


def beat(step=None, uncommitted=-1):
    """One progress report (State.commit() calls this at every call, with the calls since its
    newest snapshot: what a crash now would have the job train again, for the goodput ledger)."""
    s = _slot()
    if s is not None:
        s.beat(-1 if step is None or not isinstance(step, int) else step, uncommitted, _drawn[0])


def compute(ns):
    """One measured step's compute time, in nanoseconds (efdl/_compute.py: straggler
    detection, src/health/straggler_rules.h)."""
    s = _slot()
    if s is not None:
        s.add_compute(ns)


def watch_compute(model):
    """Measures `model`'s compute time per step (efdl/_compute.py) for straggler detection.

    State does it for the model it holds; a program without State calls
    efdl.watch_compute(model) once (the model, or its DistributedDataParallel wrapper). Outside
    `efdl run` (no progress board) it does nothing and adds no hook.
    """
    if model is None or _slot() is None:
        return
    from efdl import _compute
    _compute.watch(model, compute)


def restored():
    """State restored (or agreed on) its state for this round: what follows is the first step
    (the goodput ledger tells the two phases apart by it)."""
    s = _slot()
    if s is not None:
        s.restored()


def committed():
    """State took a snapshot: nothing is uncommitted now (not a progress report)."""
    s = _slot()
    if s is not None:
        s.committed()


def progress(step=None, expect_pause=None):
    """Tells this worker's agent that the program made progress (a training step).

    Programs with efdl.State need not call it: every State.commit() reports. `expect_pause`:
    seconds of a known stretch without progress that starts now (an evaluation, a first step
    that compiles); the hang timeout counts from its end. Outside `efdl run`, does nothing.
    """
    s = _slot()
    if s is None:
        return
    s.beat(-1 if step is None or not isinstance(step, int) else step, -1, _drawn[0])
    if expect_pause is not None:
        s.expect_pause(float(expect_pause))


@contextlib.contextmanager
def pause_expected(seconds):
    """`with efdl.pause_expected(600): evaluate()`: no hang is declared for this worker for up
    to `seconds` while the block runs; leaving the block reports progress and ends the pause."""
    s = _slot()
    if s is not None:
        s.expect_pause(float(seconds))
    try:
        yield
    finally:
        if s is not None:
            s.expect_pause(0.0)
            s.beat(-1)


def arm_stack_dump():
    """Arms faulthandler so that the agent's stack signal writes every thread's Python stack to
    EFDL_STACK_DIR/stack-<pid>.txt (done once per process; a forked spare arms its own)."""
    d = os.environ.get(Env.STACK_DIR)
    sig = os.environ.get(Env.STACK_SIGNAL)
    if not d or not sig or _armed["pid"] == os.getpid():
        return
    try:
        import faulthandler
        f = open(os.path.join(d, "stack-%d.txt" % os.getpid()), "a")
        faulthandler.register(int(sig), file=f, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        return   # the agent then says this worker wrote no stack
    _armed["pid"] = os.getpid()
    _armed["file"] = f   # faulthandler writes to its fd: keep it open
