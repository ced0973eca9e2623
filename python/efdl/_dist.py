"""torch.distributed's default group for every torch-based backend: its creation and teardown,
this process' rank and world size with or without it (the sampler's defaults, the agreement's
group size), and the "no agent yet" re-execution.

Contract: init_process_group() is idempotent and safe to call from the main thread only (it
creates torch.distributed's default group, which is process-global by torch's design).
"""

import atexit
import datetime
import gc
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from efdl import _env
from efdl._names import Env

# Set on the re-executed command so that a second arrival without agent env is an error, not a loop.
_REEXEC_MARKER = Env.REEXECUTED


def default_backend():
    return "nccl" if torch.cuda.is_available() else "gloo"


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_initialized() else _env.rank()


def world_size():
    return dist.get_world_size() if is_initialized() else _env.world_size()


def _agent_required():
    return bool(os.environ.get(Env.ETCD_ENDPOINTS)) and bool(os.environ.get(Env.JOB_ID))


def find_efdl_binary():
    """Path of the `efdl` command: EFDL_BIN when set, else PATH. Raises RuntimeError if absent."""
    explicit = os.environ.get(Env.BIN, "")
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise RuntimeError("EFDL_BIN=%s is not an executable file; point it at the built `efdl` "
                           "binary or unset it to search PATH" % explicit)
    found = shutil.which("efdl")
    if found is None:
        raise RuntimeError("EFDL_ETCD_ENDPOINTS and EFDL_JOB_ID are set, so this job runs under "
                           "the EFDL agent, but no `efdl` command was found: put it on PATH or "
                           "set EFDL_BIN (or unset EFDL_ETCD_ENDPOINTS to train as one process)")
    return found


def reexec_command(efdl_binary):
    """The command line that runs this very program under `efdl run`."""
    # orig_argv keeps interpreter options (-u, -m module, -c code) that sys.argv loses.
    program = list(getattr(sys, "orig_argv", [])[1:]) or list(sys.argv)
    return [efdl_binary, "run", "--", sys.executable] + program


def maybe_reexec_under_agent():
    """Replaces this process by `efdl run -- <this command>` when etcd is configured but no agent
    started us; returns normally otherwise."""
    if not _agent_required() or _env.under_agent():
        return
    if os.environ.get(_REEXEC_MARKER):
        raise RuntimeError("this process was re-executed under `efdl run` but still has no RANK/"
                           "WORLD_SIZE from the agent; check that EFDL_BIN runs the EFDL agent")
    command = reexec_command(find_efdl_binary())
    print("efdl: EFDL_ETCD_ENDPOINTS and EFDL_JOB_ID are set and no agent started this process; "
          "re-executing under: " + " ".join(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.environ[_REEXEC_MARKER] = "1"
    os.execv(command[0], command)


# How long a rank other than 0 waits for rank 0's store before leaving the rest to torch.
_STORE_WAIT_S = 300
_STORE_POLL_S = 0.01


def wait_for_store(host, port, timeout):
    """Returns once `host:port` (rank 0's TCPStore) accepts a connection, or after `timeout`
    seconds. torch's store client retries a refused connection only once per second (1.13), so a
    rank that comes up a moment before rank 0 would lose up to a second at every round change;
    this polls every 10 ms instead. Whatever goes wrong is left to init_process_group to report."""
    import socket
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(_STORE_POLL_S)


def init_process_group(timeout=None, backend=None):
    """Creates torch.distributed's default group from the launcher's env, or a 1-rank group.

    `timeout` is in seconds (None: torch's default). Returns without doing anything if a default
    group already exists. May replace the process (see maybe_reexec_under_agent).
    """
    if is_initialized():
        return
    maybe_reexec_under_agent()
    backend = backend or default_backend()
    kwargs = {}
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError("init(timeout=%r): timeout is in seconds and must be a positive "
                             "number" % (timeout,))
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)

    size = _env.world_size()
    if _env.has_launcher_env() and (size > 1 or os.environ.get(Env.MASTER_ADDR)):
        this_rank = _env.rank()
        if this_rank >= size:
            raise ValueError("RANK=%d is not below WORLD_SIZE=%d; the launcher's environment is "
                             "inconsistent" % (this_rank, size))
        missing = [n for n in (Env.MASTER_ADDR, Env.MASTER_PORT) if not os.environ.get(n)]
        if missing:
            raise ValueError("WORLD_SIZE=%d but %s not set: run under `efdl run` (or set them to "
                             "rank 0's address and a free port)" % (size, " and ".join(missing)))
        if this_rank != 0:
            wait_for_store(os.environ[Env.MASTER_ADDR], int(os.environ[Env.MASTER_PORT]),
                           timeout if timeout is not None else _STORE_WAIT_S)
        dist.init_process_group(backend, init_method="env://", rank=this_rank, world_size=size,
                                **kwargs)
    else:
        # A 1-process job still gets a real group so DistributedDataParallel wraps unchanged; an
        # in-memory store needs no port and no file.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    atexit.unregister(_destroy_at_exit)   # once, however many rounds create a group
    atexit.register(_destroy_at_exit)


_SETTLE_AT_EXIT_S = 0.05


def _destroy_at_exit():
    """Tears down the group that init_process_group() created while the interpreter is intact.

    Left to interpreter finalization, a gloo worker thread that drops the last reference to a
    finished collective's tensor must take the GIL to free the tensor's Python object; once the
    interpreter is finalizing, that thread is terminated in C++ code and the process aborts
    ("terminate called without an active exception", SIGABRT, after the program finished). So:
    collect cyclic garbage (a State or DDP model in a cycle) now, then destroy the group; torch
    releases the GIL while the group's destructor joins its threads. Registered at init, so it
    runs after the atexit hooks registered later (StopVote's wait for its last all-reduce).
    After an uncaught exception the interpreter keeps it, with every frame it unwound and their
    tensors, in sys.last_* while the hooks run: released first, its traceback already printed.
    """
    if not is_initialized():
        return  # the program destroyed it itself
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    dist.destroy_process_group()
    # The group is only destroyed (its threads joined) when nothing else holds it; a program's
    # globals often do (a DDP model, a ZeroRedundancyOptimizer). A gloo thread may then still be
    # freeing the tensors of the collective that just completed (its Python peer already let
    # them go) when finalization starts: the same abort. Give it that moment while the
    # interpreter is intact (a few milliseconds suffice; more under a loaded CPU).
    time.sleep(_SETTLE_AT_EXIT_S)


def shutdown():
    if is_initialized():
        dist.destroy_process_group()
