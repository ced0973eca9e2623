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

A torch.utils.data.DistributedSampler built before a round change keeps the num_replicas and
rank it was built with. When the world size changed, run watches the ones the function can
reach (its globals and closure, those of the functions it names, its arguments, the state's
attributes; directly or as a DataLoader's sampler): the first one iterated with a stale
num_replicas is said once per process, as a RuntimeWarning naming the fix.
"""

import functools
import gc
import itertools
import sys
import time
import types
import warnings

from efdl import _dist, _place
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
        state._rounds.sync()
        return func(state, *args, **kwargs)
    rounds = state._rounds   # efdl/_rounds.InProcessRounds
    rounds.in_process = True
    paused_at = None
    world = None
    stale = _StaleSamplerNotice()
    while True:
        start_group()
        step = rounds.sync()
        if paused_at is not None and _dist.world_size() != world:
            stale.watch(world, control.round, func, state, args, kwargs)
        world = _dist.world_size()
        # After a round change, and in a process whose state came from a snapshot (it joined a
        # running job, or the job continues from storage): the state predates this round.
        if paused_at is not None or state._restored is not None:
            rounds.run_reset_callbacks()
        if paused_at is not None:
            if _dist.rank() == 0:
                # The State's step (its "step" value, else the job's commit count), as the
                # agent's "paused ... after its commit of step S" line names it.
                if step is not None:
                    origin = "from the snapshot of step %s" % step
                else:   # nothing to agree on: the state in memory, as it paused
                    origin = "with the state they paused with (step %s)" % state._last_step
                sys.stderr.write("efdl: round %d: %d rank(s) continue in-process %s "
                                 "(%.2f s since the pause)\n"
                                 % (control.round, _dist.world_size(), origin,
                                    time.monotonic() - paused_at))
                sys.stderr.flush()
        failure = None
        try:
            result = func(state, *args, **kwargs)
            control.notify_returned()
            return result
        except RoundChangeInterrupt:
            pass
        except SystemExit as e:
            if e.code in (None, 0):
                control.notify_returned()
            raise
        except Exception as e:  # noqa: BLE001 - only collective failures are kept (below)
            if not (is_collective_failure(e) or control.pause_request() is not None):
                control.notify_raised(_first_line(e))   # the program's own: before teardown
                raise
            failure = _first_line(e)
            control.notify_failed(failure)
        paused_at = time.monotonic()
        _leave_round(state, failure is None, stop_group)
        control.notify_paused(state._last_step, snapshot=failure is None)
        place = control.wait_for_round()
        if place is None:
            raise SystemExit(0)   # the agent stops this worker instead: its snapshot is taken
        _place.apply(place, control)   # the environment start_group() reads, the client's round
        _retitle()


def _leave_round(state, clean, stop_group):
    """Destroys the round's process group. What the training function built on it (its DDP
    wrapper, buckets and hooks) was released with its frame; collecting cycles now makes sure
    the group's sockets close here, so peers still waiting on this rank fail at once."""
    state._rounds.leave(clean)
    gc.collect()
    stop_group()


class _StaleSamplerNotice:
    """Says once per process that a torch DistributedSampler built before a round change is
    iterated with the old world's num_replicas (module docstring)."""

    def __init__(self):
        self.said = False
        self.round = 0

    def watch(self, old_world, round_, func, state, args, kwargs):
        """Marks the reachable torch DistributedSamplers of `old_world` ranks: each is checked
        when next iterated (its class is swapped for a checking subclass until then)."""
        if self.said:
            return
        self.round = round_
        for sampler in _reachable_samplers(func, state, args, kwargs):
            if sampler.num_replicas == old_world and not getattr(type(sampler), "_efdl_watch",
                                                                   False):
                sampler.__dict__["_efdl_stale_notice"] = self
                sampler.__class__ = _watching_class(type(sampler))

    def check(self, sampler):
        world = _dist.world_size()
        if self.said or sampler.num_replicas == world:
            return
        self.said = True
        warnings.warn(
            "efdl: round %d: a torch.utils.data.DistributedSampler built before this round "
            "still has num_replicas=%d, but the job now has %d ranks: this rank keeps its old "
            "share of the data and the job skips or repeats samples every epoch. Build the "
            "sampler and its DataLoader inside the @efdl.elastic.run (@hvd.elastic.run) "
            "function, or use efdl.data.DistributedSampler and call its update(num_replicas=, "
            "rank=) in a reset callback (with Horovod: hvd.elastic.ElasticSampler)"
            % (self.round, sampler.num_replicas, world), RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _watching_class(cls):
    """A subclass of `cls` whose __iter__ checks once, then gives the sampler its class back."""
    def __iter__(self):
        notice = self.__dict__.pop("_efdl_stale_notice", None)
        self.__class__ = cls
        if notice is not None:
            notice.check(self)
        return cls.__iter__(self)
    return type(cls.__name__, (cls,), {"__iter__": __iter__, "_efdl_watch": True,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _code_names(code, names):
    names.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, names)


def _function_values(fn):
    """The global values the code of `fn` names, and its closure's values."""
    fn = getattr(fn, "__wrapped__", fn)
    if not isinstance(fn, types.FunctionType):
        return []
    names = set()
    _code_names(fn.__code__, names)
    values = [fn.__globals__[n] for n in names if n in fn.__globals__]
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:   # an empty cell
            pass
    return values


def _reachable_samplers(func, state, args, kwargs):
    """torch DistributedSamplers the training function can reach (module docstring)."""
    import torch.utils.data as tud   # the program runs torch; not imported before it is needed
    values = _function_values(func)
    # One level into the functions it calls by name (a train_epoch(loader) helper).
    values += [v for f in list(values) if isinstance(f, types.FunctionType)
               for v in _function_values(f)]
    values += list(args) + list(kwargs.values()) + list(getattr(state, "__dict__", {}).values())
    found = {}
    for value in values:
        # A container's first few items only: a global list may be a whole data set.
        items = list(itertools.islice(value.values(), 16)) if isinstance(value, dict) else \
            list(itertools.islice(value, 16)) if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, tud.DataLoader):
                batch = getattr(item, "batch_sampler", None)
                items_of = [item.sampler, getattr(batch, "sampler", None)]
            else:
                items_of = [item]
            for s in items_of:
                if isinstance(s, tud.distributed.DistributedSampler):
                    found[id(s)] = s
    return list(found.values())


def _retitle():
    """A worker forked from the zygote (its ps name is efdl-rank<N>, efdl/preload.py) takes the
    new round's rank in its process title."""
    try:
        with open("/proc/self/comm") as f:
            if not f.read().startswith("efdl-rank"):
                return
    except OSError:
        return
    from efdl import preload
    preload.set_worker_title()
