"""Recovery without restarting the surviving processes: `efdl.elastic.run`.

    import efdl.backend.torch as efdl

    state = efdl.State(model, optimizer, epoch=0, samples=0)
    state.register_reset_callbacks([on_reset])        # after every in-process round change

    @efdl.elastic.run
    def train(state):
        ddp = torch.nn.parallel.DistributedDataParallel(state.model)   # built per round
        sampler = efdl.data.DistributedSampler(dataset, epoch=state.epoch,
                                               global_start_index=state.samples)
        ...                                            # state.commit() every step

    train(state)

Under `efdl run` the worker tells its agent that it takes round changes in-process. When the
membership changes, the agent asks it to pause: the next commit() takes the snapshot (every rank
at the same step: the ranks agree on stops) and raises RoundChangeInterrupt, which run catches.
When a collective fails instead (a peer died), run catches the error, and the state goes back
to the newest snapshot. Either way run then destroys the process group, waits for the next
round's place from the agent (rank, world size, master address: the environment a new worker
would get), creates the new process group, makes every rank agree on the state (newcomers
receive it from a rank that holds it), calls the reset callbacks and calls the function again.

The agent falls back to its restart path (the worker is stopped; a new one starts and restores
the snapshot) when a worker does not pause within --stop-grace (gloo cannot interrupt a
collective waiting for a frozen peer), when the node's worker count changes, and for programs
without this decorator. Outside `efdl run` the function runs once, in the process group of
efdl.init(). docs/user-guide.md, "Recovery without restart".
"""

import functools
import gc
import os
import sys
import time

from efdl import _dist
from efdl._rounds import RoundChangeInterrupt

__all__ = ["run", "run_rounds", "RoundChangeInterrupt", "is_collective_failure"]

# What torch 1.13's gloo and NCCL process groups and the TCP store say when a peer is gone.
_FAILURE_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                  "Socket Timeout", "Timed out", "timed out", "failed to recv", "failed to send",
                  "Connection refused", "ProcessGroup", "NCCL", "gloo", "Gloo")


def is_collective_failure(error):
    """Whether `error` says a collective or the process group's store lost a peer (then run
    continues in the next round; any other exception ends the worker as without run). An
    exception that says so itself (`efdl_collective_failure = True`, as hvd.HorovodInternalError
    does) counts too."""
    if getattr(error, "efdl_collective_failure", False):
        return True
    return isinstance(error, RuntimeError) and any(w in str(error) for w in _FAILURE_WORDS)


def _first_line(error):
    text = str(error).strip().splitlines()
    return "%s: %s" % (type(error).__name__, text[0] if text else "")


def run(func):
    """Decorator: runs `func(state, ...)` across in-process round changes (module docstring).
    The first argument must be the efdl.State that the function trains."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return run_rounds(func, state, args, kwargs)
    return wrapper


def run_rounds(func, state, args, kwargs, start_group=_dist.init_process_group,
               stop_group=_dist.shutdown):
    """The loop of run(): `start_group()` creates the round's process group from the
    environment (a no-op when one exists), `stop_group()` destroys it (hvd.elastic.run passes
    its layer's init and shutdown)."""
    control = getattr(state, "_control", None)
    if control is not None and not control.announce_in_process():
        sys.stderr.write("efdl: the agent did not take this worker's round changes in-process "
                         "(an older efdl?): it is stopped and started again at each one\n")
        control = None
    if control is None:
        # Not under `efdl run` (or its agent is unreachable): one round, no round changes.
        start_group()
        state._sync_round()
        return func(state, *args, **kwargs)
    state._in_process = True
    paused_at = None
    while True:
        start_group()
        step = state._sync_round()
        # After a round change, and in a process whose state came from a snapshot (it joined a
        # running job, or the job continues from storage): the state predates this round.
        if paused_at is not None or state._restored is not None:
            state._run_reset_callbacks()
        if paused_at is not None:
            if _dist.rank() == 0:
                sys.stderr.write("efdl: round %d: %d rank(s) continue in-process from step %s "
                                 "(%.2f s since the pause)\n"
                                 % (control.round, _dist.world_size(), step,
                                    time.monotonic() - paused_at))
                sys.stderr.flush()
        failure = None
        try:
            return func(state, *args, **kwargs)
        except RoundChangeInterrupt:
            pass
        except Exception as e:  # noqa: BLE001 - only collective failures are kept (below)
            if not (is_collective_failure(e) or control.pause_request() is not None):
                raise
            failure = _first_line(e)
            control.notify_failed(failure)
        paused_at = time.monotonic()
        _leave_round(state, failure is None, stop_group)
        control.notify_paused(state._last_step, snapshot=failure is None)
        env = control.wait_for_round()
        if env is None:
            raise SystemExit(0)   # the agent stops this worker instead: its snapshot is taken
        os.environ.update(env)


def _leave_round(state, clean, stop_group):
    """Destroys the round's process group. What the training function built on it (its DDP
    wrapper, buckets and hooks) was released with its frame; collecting cycles now makes sure
    the group's sockets close here, so peers still waiting on this rank fail at once."""
    state._leave_round(clean)
    gc.collect()
    stop_group()
