"""Horovod backends: efdl.backend.horovod.{torch, tensorflow, tensorflow.keras}.

Each exposes `hvd`: the real Horovod module when it is installed, initialised from the agent's
HOROVOD_* environment, else (PyTorch only) EFDL's Horovod-API layer over torch.distributed.
EFDL_HOROVOD chooses: `auto` (default: real Horovod when importable), `native` (require real
Horovod), `torch` (always the layer).
"""

import importlib
import importlib.util
import os

from efdl import _env
from efdl._names import Env

_CHOICES = ("auto", "native", "torch")


def choice():
    value = os.environ.get(Env.HOROVOD, "auto") or "auto"
    if value not in _CHOICES:
        raise ValueError("EFDL_HOROVOD=%r: use one of %s" % (value, ", ".join(_CHOICES)))
    return value


# The directory `efdl run --horovod` puts in front of the workers' PYTHONPATH: its `horovod`
# package is EFDL's stand-in (python/efdl/_horovod_shim/horovod), never real Horovod.
SHIM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "_horovod_shim")


def horovod_is_shim():
    """Whether `import horovod` gives EFDL's stand-in (efdl run --horovod); looks without
    importing it."""
    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) or ""
    return bool(origin) and os.path.dirname(os.path.dirname(os.path.abspath(origin))) == SHIM_DIR


def import_native(module, install_hint):
    """The real Horovod module `module` (e.g. "horovod.tensorflow"), or ImportError whose message
    is one line saying what to install."""
    if horovod_is_shim():
        raise ImportError("%s is EFDL's stand-in for Horovod (efdl run --horovod), not real "
                          "Horovod: %s" % (module, install_hint))
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError("%s is not importable (%s): %s" % (module, e, install_hint)) from None


def native_env_problem():
    """Why real Horovod cannot join this job, or None.

    A worker of a multi-process job started by the agent (RANK / WORLD_SIZE) needs the HOROVOD_*
    variables for Horovod's Gloo controller; without them hvd.init() would silently make every
    worker a 1-process job.
    """
    if not _env.has_launcher_env() or _env.world_size() <= 1:
        return None
    if os.environ.get(Env.HOROVOD_RANK) and os.environ.get(Env.HOROVOD_GLOO_RENDEZVOUS_ADDR):
        return None
    return ("WORLD_SIZE=%d but no HOROVOD_RANK / HOROVOD_GLOO_RENDEZVOUS_ADDR: this agent does "
            "not serve Horovod's rendezvous, so real Horovod would train each worker alone"
            % _env.world_size())
