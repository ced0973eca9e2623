"""Horovod for PyTorch under EFDL.

    import efdl.backend.horovod.torch as hvd            # instead of: import horovod.torch as hvd
    hvd.init(); hvd.size(); hvd.DistributedOptimizer(...); hvd.elastic.run ...

The module is the whole Horovod API: every name of `hvd` (below) is reachable on it as the same
object (a module __getattr__), next to EFDL's own (get_rank, ..., data, State). The older
spelling `from efdl.backend.horovod.torch import hvd` gives that `hvd` itself.

`hvd` is the real horovod.torch when it is installed (and EFDL_HOROVOD is not `torch`); the
agent provides the HOROVOD_* variables its Gloo controller reads. Otherwise it is EFDL's
Horovod-API layer over torch.distributed (see _layer.py and docs/horovod.md).
"""

import warnings

from efdl import _env
from efdl._names import Env
from efdl.backend.horovod import choice, import_native, native_env_problem

_INSTALL_HINT = ("install Horovod built with PyTorch (HOROVOD_WITH_PYTORCH=1 pip install horovod) "
                 "or set EFDL_HOROVOD=torch to use EFDL's layer over torch.distributed")


def _select():
    if choice() == "torch":
        from efdl.backend.horovod.torch import _layer
        return _layer, False
    try:
        native = import_native("horovod.torch", _INSTALL_HINT)
    except ImportError:
        if choice() == "native":
            raise
        from efdl.backend.horovod.torch import _layer
        return _layer, False
    problem = native_env_problem()
    if problem is None:
        return native, True
    if choice() == "native":
        raise ImportError("EFDL_HOROVOD=native: " + problem)
    warnings.warn(problem + "; using EFDL's Horovod layer over torch.distributed instead",
                  RuntimeWarning)
    from efdl.backend.horovod.torch import _layer
    return _layer, False


hvd, NATIVE = _select()

# After the choice, so that a failed `native` choice fails before torch is imported.
from efdl import data, resume  # noqa: E402
from efdl.resume import exact_resume, resume_step  # noqa: E402

__all__ = ["hvd", "NATIVE", "init", "is_initialized", "get_rank", "get_world_size",
           "get_local_rank", "get_local_world_size", "data", "resume", "resume_step",
           "exact_resume"]


def init(comm=None, process_sets=None, timeout=None, backend=None):
    """hvd.init() for this round (Horovod's `comm` / `process_sets` go to hvd.init). `timeout` /
    `backend` apply to EFDL's layer only (they are accepted and ignored with real Horovod, which
    takes HOROVOD_GLOO_TIMEOUT_SECONDS)."""
    if NATIVE:
        kwargs = {"comm": comm} if comm is not None else {}
        if process_sets:
            kwargs["process_sets"] = process_sets
        hvd.init(**kwargs)
        return
    if comm is not None or process_sets:
        hvd.init(comm=comm, process_sets=process_sets)   # the layer's one-line refusal
    hvd.start(timeout=timeout, backend=backend)


# is_initialized and the rest of Horovod's API: __getattr__ below (hvd's own objects).


def get_rank():
    return hvd.rank() if hvd.is_initialized() else _env.launcher_int(Env.HOROVOD_RANK, _env.rank())


def get_world_size():
    if hvd.is_initialized():
        return hvd.size()
    return _env.launcher_int(Env.HOROVOD_SIZE, _env.world_size(), minimum=1)


def get_local_rank():
    if hvd.is_initialized():
        return hvd.local_rank()
    return _env.launcher_int(Env.HOROVOD_LOCAL_RANK, _env.local_rank())


def get_local_world_size():
    if hvd.is_initialized():
        return hvd.local_size()
    return _env.launcher_int(Env.HOROVOD_LOCAL_SIZE, _env.local_world_size(), minimum=1)


def __getattr__(name):
    # State and its errors live with the torch backend (one snapshot engine for both APIs).
    from efdl.backend import torch as torch_backend
    if name in torch_backend._STATE_NAMES:
        return getattr(torch_backend, name)
    # Everything else of Horovod's API (size, rank, DistributedOptimizer, elastic, ...): hvd's
    # own object, so that `import efdl.backend.horovod.torch as hvd` is a complete `hvd`.
    if not name.startswith("__"):
        try:
            return getattr(hvd, name)
        except AttributeError:
            pass
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    return sorted(set(globals()) | set(getattr(hvd, "__all__", dir(hvd))) | {"elastic"})
