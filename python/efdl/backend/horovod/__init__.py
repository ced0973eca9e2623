"""Horovod backends: efdl.backend.horovod.{torch, tensorflow, tensorflow.keras}.

Each exposes `hvd`: the real Horovod module when it is installed, initialised from the agent's
HOROVOD_* environment, else (PyTorch only) EFDL's Horovod-API layer over torch.distributed.
EFDL_HOROVOD chooses: `auto` (default: real Horovod when importable), `native` (require real
Horovod), `torch` (always the layer).
"""

import importlib
import os

_CHOICES = ("auto", "native", "torch")


def choice():
    value = os.environ.get("EFDL_HOROVOD", "auto") or "auto"
    if value not in _CHOICES:
        raise ValueError("EFDL_HOROVOD=%r: use one of %s" % (value, ", ".join(_CHOICES)))
    return value


def import_native(module, install_hint):
    """The real Horovod module `module` (e.g. "horovod.tensorflow"), or ImportError whose message
    is one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError("%s is not importable (%s): %s" % (module, e, install_hint)) from None
