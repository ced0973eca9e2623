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


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module("efdl." + name)
    raise AttributeError("module 'efdl' has no attribute %r" % name)
