"""EFDL for torch DDP programs: `import efdl.backend.torch as efdl`.

    efdl.init()                      # process group from the agent's env (or a 1-process job)
    efdl.get_rank(), efdl.get_world_size(), efdl.get_local_rank(), efdl.get_local_world_size()
    efdl.data.DistributedSampler(...)
    efdl.resume_step(...), efdl.exact_resume(...)   # see efdl.resume
    @efdl.elastic.run                # round changes without restarting the process (elastic.py)

The get_* functions work with or without init(): before it they read the launcher's env
(1-process defaults: rank 0 of 1).
"""

from efdl import _dist, _env, data, resume
from efdl.backend.torch import elastic
from efdl._progress import pause_expected, progress, watch_compute
from efdl.resume import exact_resume, resume_step

__all__ = ["init", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
           "get_local_world_size", "data", "resume", "resume_step", "exact_resume", "elastic",
           "progress", "pause_expected", "watch_compute"]


def init(timeout=None, backend=None):
    """Creates the torch.distributed process group for this round.

    Under `efdl run` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) the
    group spans the round; run as a plain `python3 train.py` it is a 1-rank group, so
    DistributedDataParallel still wraps. When EFDL_ETCD_ENDPOINTS and EFDL_JOB_ID are set but no
    agent started this process, the same command is re-executed under `efdl run` (found through
    EFDL_BIN or PATH). `backend`: nccl when CUDA is available, else gloo. `timeout`: seconds for
    collectives and for forming the group. Calling init() again is a no-op.
    """
    _dist.init_process_group(timeout=timeout, backend=backend)


def is_initialized():
    return _dist.is_initialized()


def get_rank():
    return _dist.rank()


def get_world_size():
    return _dist.world_size()


def get_local_rank():
    return _env.local_rank()


def get_local_world_size():
    return _env.local_world_size()


# State lives in python/efdl/state.py; it needs the compiled efdl._efdl, so it is imported on
# first use (efdl.State), not with this module.
_STATE_NAMES = ("State", "SnapshotError", "SnapshotMismatchError")
__all__ += list(_STATE_NAMES)


def __getattr__(name):
    if name in _STATE_NAMES:
        from efdl import state
        return getattr(state, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
