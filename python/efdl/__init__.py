"""EFDL: elastic and fault-tolerant training for PyTorch DDP and Horovod jobs.

User code imports a backend, not this package:

    import efdl.backend.torch as efdl            # torch DDP
    import efdl.backend.horovod.torch as hvd     # Horovod API

Importing `efdl` itself stays cheap (no torch import); the submodules `data`, `resume` and
`backend` load on first attribute access.
"""

import importlib

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("backend", "data", "resume")


def progress(step=None, expect_pause=None):
    """Reports progress to this worker's agent (hang detection, docs/operations.md "Hangs");
    also efdl.backend.torch.progress. State.commit() reports by itself."""
    from efdl import _progress
    _progress.progress(step, expect_pause)


def pause_expected(seconds):
    """`with efdl.pause_expected(S): ...`: a known stretch of up to S seconds without progress."""
    from efdl import _progress
    return _progress.pause_expected(seconds)


def watch_compute(model):
    """Measures `model`'s compute time per step for straggler detection (docs/operations.md
    "Stragglers"); State does it for its model. Does nothing outside `efdl run`."""
    from efdl import _progress
    _progress.watch_compute(model)


def _arm_stack_dump_under_efdl_run():
    # Cheap outside `efdl run`: only a worker of an agent loads the compiled module here.
    from efdl import _env
    if _env.under_agent():
        from efdl import _progress
        _progress.arm_stack_dump()


_arm_stack_dump_under_efdl_run()


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module("efdl." + name)
    raise AttributeError("module 'efdl' has no attribute %r" % name)
