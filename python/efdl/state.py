"""efdl.State: snapshot and restore of a training job's state (spec section 3.2).

    state = efdl.State(model, optimizer, scheduler, epoch=0, step=0)
    state.set_commit_interval(100)
    ...
    state.commit()            # every step; snapshots when state.step meets the interval

commit() copies every tensor (model, optimizer and scheduler state, tensor-valued keyword
arguments) as raw bytes into a shared-memory arena of the node (efdl._efdl, C++), together with
a manifest; non-tensor values travel in the manifest: plain keyword arguments (int, float, str,
...) as JSON, the others, optimizer hyper-parameters and the scheduler's state as a small pickle.
It returns as soon as the copy is done; a background thread persists the newest snapshot to
<EFDL_SNAPSHOT_DIR>/<job id>/ (default ./efdl-snapshots) - under `efdl run` the node agent does
that instead, from the same arena. Constructing a State restores the newest snapshot of the job:
from shared memory when this node holds it (it survives the death of the process that wrote it),
else from storage. See docs/snapshots.md.

Environment: EFDL_JOB_ID (default: derived from the script's path), EFDL_SNAPSHOT_DIR,
EFDL_SNAPSHOT_KEEP (2), EFDL_SNAPSHOT_PER_RANK (0: one copy per node, written by local rank 0,
for data-parallel jobs where all ranks hold the same state; 1: one per rank, for states that
differ by rank, restorable at the same world size only),
EFDL_SHM_DIR (/dev/shm), EFDL_SNAPSHOT_THREADS, EFDL_PERSIST_MIN_INTERVAL_MS (1000: storage gets
about one commit a second, the commits whose seq is a multiple of the power of two of commits
that spans it, the same on every node; exit, SIGTERM and graceful stops persist the newest at once),
EFDL_AGENT_PERSISTS (1, set by `efdl run`: the node agent persists, the worker never writes
storage and flush() asks the agent to persist now), EFDL_SNAPSHOT_HMAC (1: stored snapshots carry
an HMAC-SHA256 keyed with the job's secret EFDL_JOB_SECRET and restore only when it verifies),
EFDL_COMMIT_CHECKSUM (0; 1: every commit stores its data checksum, so a restore from memory
always verifies it, at a cost per commit: docs/snapshots.md), EFDL_UNPICKLE_ALLOW (types a
snapshot's metadata may hold beyond the allow-list of efdl/_unpickle.py, `module.Name,...`),
EFDL_RESTORE_OTHER_PROGRAM (1: restore a snapshot another program wrote under the same job id;
refused by default). The arena's name comes from efdl._efdl.arena_path (EFDL_ARENA_HOLDER, set by
`efdl run`, or "<host>.0" without an agent); a standalone program removes its arena once its
final snapshot is persisted at exit.

State holds replicated state, and torch's ZeroRedundancyOptimizer with per-rank snapshots
(EFDL_SNAPSHOT_PER_RANK=1): each rank commits its shard with its layout, and after a world-size
change every rank rebuilds its shard of the new layout from the old shards - this node's
memory, other ranks over the network, a node's peer copy, else storage (efdl/_shards.py). A
model or optimizer it cannot restore across a world-size change (FSDP, another sharded
optimizer, ...) is refused at construction and at the setters with one TypeError line
(efdl/_parts.py, check_model and check_optimizer).

Here: State's construction, commit(), flush(), the restore and the graceful stop. What varies by
kind of value (model, optimizer, scheduler, keyword arguments) is in efdl/_parts.py, the meta
text in efdl/_manifest.py, the commit's tensor plan and the compiled path's inputs in
efdl/_commit.py.
"""

import atexit
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
import weakref

from efdl import (_agreement, _commit, _dist, _efdl, _env, _manifest, _parts, _place, _progress,
                  _rounds, _shards)
from efdl._manifest import program_name
from efdl._names import Env
from efdl._parts import SnapshotMismatchError

__all__ = ["State", "SnapshotMismatchError", "SnapshotError"]

SnapshotError = _efdl.SnapshotError
RESTORE_OTHER_PROGRAM_ENV = _manifest.RESTORE_OTHER_PROGRAM_ENV  # offered here as before

_RESERVED_ORDER = ("model", "optimizer", "scheduler")
_RESERVED = frozenset(_RESERVED_ORDER)
_FLUSH_TIMEOUT_S = 600.0
# How long the ranks look again for the old shards a sharded snapshot lacks (_agreed_sharded):
# a graceful leave's final shard reaches storage within this; a lost host's never does, and its
# recovery waits this much longer.
_SHARD_RETRIES = 15
_SHARD_RETRY_S = 0.2


def _safe_name(text):
    # The job id as arena names hold it (snapshot/arena_dir.h); bench/snapshot.py uses it.
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80]


def _remove_arena(path, shm_dir, box, key):
    """Removes a standalone program's arena, then drops its shared holder lock box[key] (the
    only reference to it); the lock file goes once no process holds it (any lock file nobody
    holds and no arena belongs to)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    box[key] = None
    _efdl.remove_orphan_locks(shm_dir)


def default_job_id():
    """EFDL_JOB_ID, or a stable id for this script (so re-running it restores its snapshots)."""
    job = os.environ.get(Env.JOB_ID, "").strip()
    if job:
        return job
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    # One owner with `efdl run` without --etcd (snapshot/arena_dir.h LocalJobId).
    return _efdl.local_job_id(os.path.realpath(script) if script else "")


class State(_rounds.RoundsHost):
    """Training state that survives restarts. See the module docstring."""

    # -- what a subclass may use and override (hvd.elastic.TorchState does) ---------------------
    # The State's public names are its API and the program's own values, so these are protected:
    #  - _sampler_kinds: keyword values of these types are samplers (efdl/_parts.SamplerPart);
    #  - _rounds: the in-process rounds (efdl/_rounds.InProcessRounds, its methods public);
    #  - _save() and _check_stop(): commit()'s snapshot and its stop agreement, apart;
    #  - the hooks of efdl/_rounds.RoundsHost: _round_change, _on_round_synced.
    _sampler_kinds = ()

    def __init__(self, model=None, optimizer=None, scheduler=None, **kwargs):
        # What State cannot restore across a world-size change (a sharded optimizer, FSDP) is
        # refused before anything is opened: one TypeError line (efdl/_parts.py).
        _parts.check_model(model)
        _parts.check_optimizer(optimizer)
        d = self.__dict__
        # The parts (efdl/_parts.py); State's model, optimizer and scheduler are their objects.
        d["_model"] = _parts.ModelPart()
        d["_optimizer"] = _parts.OptimizerPart()
        d["_scheduler"] = _parts.SchedulerPart()
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, self._sampler_kinds)}
        values = {k: v for k, v in kwargs.items() if k not in samplers}
        d["_samplers"] = _parts.SamplerPart(samplers)
        d["_samplers"].save(values)   # a snapshot restored below replaces them
        d["_kwargs"] = _parts.KwargsPart(values)
        d["_values"] = d["_kwargs"].obj   # the keyword arguments: the same dict, read per step
        d["_interval"] = 1
        d["_commits"] = 0
        d["_since_snapshot"] = 0   # commit() calls since the newest snapshot (progress board)
        # A State without a "step" value numbers its snapshots by commit() calls: this process'
        # count plus this offset, which continues the count of the snapshot it restored (_adopt),
        # so that every rank's "step" is the job's one counter, not each process' own.
        d["_commit_offset"] = 0
        d["_plan"] = None          # efdl._commit.Plan of the last commit
        d["_restored"] = None
        d["_restored_meta"] = None
        d["_lock"] = threading.Lock()
        d["_program"] = program_name()   # recorded in every snapshot; checked at restore
        d["_manifest"] = _manifest.MetaWriter(d["_program"])
        d["_vote"] = None
        d["_vote_checked"] = False
        d["_fast"] = None          # efdl._efdl.FastCommit of the current plan, see _snapshot
        d["_fast_enabled"] = _env.env_flag(Env.FAST_COMMIT, True)
        d["_fast_strikes"] = 0     # fast paths dropped after < 4 commits, in a row: _make_fast
        d["_fast_retry"] = 0       # no fast path before this many commits
        d["_rounds"] = _rounds.InProcessRounds(self)   # in-process round changes
        # The sharded agreement of the last restore, for the ZeroRedundancyOptimizer given next
        # (efdl/_shards.py; _agreed_sharded, _restore_zero); dropped at the next commit.
        d["_shard_ctx"] = None

        rank, local_rank = _env.rank(), _env.local_rank()
        # EFDL_SNAPSHOT_PER_RANK, _KEEP, EFDL_PERSIST_MIN_INTERVAL_MS and EFDL_SNAPSHOT_HMAC: one
        # parser with the agent (snapshot/persist_settings.h); ValueError for a refused value.
        settings = _efdl.persist_settings()
        per_rank = settings.per_rank
        self._per_rank = per_rank
        self._settings = settings
        self._check_zero(optimizer)
        self._job = default_job_id()
        shm_dir = _efdl.shm_dir()
        self._shm_dir = shm_dir
        # The arena's name comes from the C++ core (snapshot/arena_dir.h), which the agent, its
        # persister and the cleanup use too. Under `efdl run` the agent holds the holder lock
        # and names the holder (EFDL_ARENA_HOLDER); a standalone process shares "<host>.0" by
        # a shared lock, so a live program's arena is never taken for a dead one's.
        holder = os.environ.get(Env.ARENA_HOLDER, "").strip()
        self._holder_lock = None
        if not holder:
            holder = _efdl.holder_name(socket.gethostname(), 0)
            self._holder_lock = _efdl.HolderLock.lock_shared(
                shm_dir, self._job, holder, "python State, job %s" % self._job)
        self._holder = holder
        self._snapshot_base = os.environ.get(Env.SNAPSHOT_DIR, "efdl-snapshots")
        # Under `efdl run` with a snapshot directory the agent stores the arena, not this process.
        self._agent_persists = _env.env_flag(Env.AGENT_PERSISTS, False)
        self._last_step = None  # step of this process' newest commit (for "persisted" reports)
        self._open_engine(rank, local_rank)
        self._control = self._connect_control()

        world = self._agreement_world()
        if world:
            self._restore_agreed(world)
            self._rounds.agreed_at_construction()   # see efdl/_rounds.py, sync
        else:
            self._restore_newest()
        if self._restored is not None and rank == 0:
            self._announce_restore()
        self._model.set(model)
        self._optimizer.set(optimizer)
        self._scheduler.set(scheduler)
        given = [p for p in _RESERVED_ORDER if getattr(self, p) is not None]
        if self._restored is not None and given:
            self._restore_parts(given)  # one pass over the snapshot for all of them
        if self._restored is None:
            self._samplers.load(self._values)   # deal the epoch to the ranks (restored: _adopt)
        self._install_exit_hooks()
        _progress.restored()   # the ledger's restore phase ends here, the first step begins
        _progress.watch_compute(model)   # each step's compute time, for straggler detection

    # -- attributes: keyword arguments are user state -------------------------------------------

    def __getattr__(self, name):
        samplers = self.__dict__.get("_samplers")
        if samplers is not None and name in samplers.obj:
            return samplers.obj[name]
        values = self.__dict__.get("_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError("State has no attribute %r (pass it to State(...) as a keyword "
                             "argument to keep it in snapshots)" % name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            self.__dict__[name] = value
        elif name in _RESERVED:
            getattr(self, "set_and_restore_" + name)(value)
        else:
            self._values[name] = value

    def __delattr__(self, name):
        if name in self._values:
            del self._values[name]
        else:
            object.__delattr__(self, name)

    # Setting one (state.model = ...) restores it: __setattr__, set_and_restore_*.
    @property
    def model(self):
        return self._model.obj

    @property
    def optimizer(self):
        return self._optimizer.obj

    @property
    def scheduler(self):
        return self._scheduler.obj

    # -- setters that restore ------------------------------------------------------------------

    def set_and_restore_model(self, model):
        """Sets the model (the unwrapped module, not DDP) and restores it from the snapshot."""
        self._model.set(model)
        self._plan = None
        if self._restored is not None and model is not None:
            self._restore_parts(["model"])

    def set_and_restore_optimizer(self, optimizer):
        _parts.check_optimizer(optimizer)
        self._check_zero(optimizer)
        self._optimizer.set(optimizer)
        self._plan = None
        if self._restored is not None and optimizer is not None:
            self._restore_parts(["optimizer"])

    def set_and_restore_scheduler(self, scheduler):
        self._scheduler.set(scheduler)
        self._plan = None
        if self._restored is not None and scheduler is not None:
            self._restore_parts(["scheduler"])

    # The user's existing API spells these so; both spellings keep working.
    set_and_resotre_model = set_and_restore_model
    set_and_resotre_optimizer = set_and_restore_optimizer
    set_and_resotre_scheduler = set_and_restore_scheduler

    def set_commit_interval(self, n):
        """commit() then snapshots only when state.step is a multiple of n."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("set_commit_interval needs a positive integer, got %r" % (n,))
        self._interval = n

    def register_reset_callbacks(self, callbacks):
        """Functions called without arguments under efdl.elastic.run after every in-process
        round change, once the ranks agreed on the state and before the training function runs
        again (e.g. to scale the learning rate with the new world size); also in a new process
        whose state was restored from a snapshot (it joined a running job), never at a fresh
        start."""
        self._rounds.add_reset_callbacks(callbacks)

    @property
    def job_id(self):
        return self._job

    @property
    def storage_dir(self):
        return self._storage_dir

    @property
    def arena_path(self):
        return self._arena_path

    @property
    def restored_from(self):
        """(source, seq, step) of the snapshot restored at construction, or None."""
        ref = self._restored
        return None if ref is None else (ref.source, ref.seq, ref.step)

    # -- commit --------------------------------------------------------------------------------

    def commit(self):
        """Snapshots when state.step meets the commit interval (or the agent asked to stop).

        Returns True when a snapshot was taken. When the node's agent asked this worker to stop
        (a graceful round change), snapshots regardless of the interval, persists it, and exits
        the process with status 0. With a process group of more than one rank, the ranks agree
        on the stop (efdl._agreement.StopVote): all of them stop at the same call, within about
        0.1 s of calls after the first rank saw the request - so every rank must call commit()
        equally often. Under efdl.elastic.run a round change does not end the process: after
        the snapshot, commit() raises RoundChangeInterrupt, which run catches (efdl/_rounds.py).
        """
        d = self.__dict__  # per-step path: plain dict access, not State.__setattr__
        if d["_samplers"].obj:
            d["_samplers"].save(d["_values"])
        step = d["_values"].get("step", d["_commits"] + d["_commit_offset"])
        d["_since_snapshot"] += 1
        # Hang detection and the goodput ledger: this rank made progress (a few stores).
        _progress.beat(step, d["_since_snapshot"])
        stop = self._stop_agreed()
        d["_commits"] += 1
        if not stop and d["_interval"] > 1:
            try:
                if step % self._interval != 0:
                    return False
            except TypeError:
                pass
        took = False
        if self._writer:
            self._snapshot(step)
            took = True
        # The job's snapshot of this step exists (this rank's, or its writer's).
        d["_since_snapshot"] = 0
        _progress.committed()
        if stop:
            self._stop_now(step)
        return took

    def _save(self):
        """For subclasses: snapshots the current step now, whatever the interval, without the
        stop agreement; returns the step."""
        d = self.__dict__
        d["_samplers"].save(d["_values"])
        step = d["_values"].get("step", d["_commits"] + d["_commit_offset"])
        if d["_writer"]:
            self._snapshot(step)
        return step

    def _check_stop(self):
        """For subclasses: commit()'s stop agreement alone; when the ranks stop (or pause) here,
        snapshots the current step and stops as commit() does. Every rank must call it as often
        as the others."""
        if self._stop_agreed():
            self._stop_now(self._save())

    def _stop_agreed(self):
        """Whether this worker stops (or, under efdl.elastic.run, pauses) at this call: the
        agent's request, agreed on by the ranks of the round (StopVote). Every rank must call
        it as often as the others; commit() does, once per call."""
        d = self.__dict__
        control = d["_control"]
        stop = control is not None and control.stop_requested()
        if not d["_vote_checked"]:
            d["_vote_checked"] = True
            if _agreement.group_size():
                d["_vote"] = _agreement.StopVote()
        if d["_vote"] is not None:
            stop = d["_vote"].poll(stop)
        return stop

    def flush(self, timeout=_FLUSH_TIMEOUT_S):
        """Waits until the newest snapshot is in storage (raises SnapshotError on failure).

        Under the node agent (EFDL_AGENT_PERSISTS=1) the agent writes storage: flush() asks it,
        through the control socket, to persist this worker's arena now and waits for its answer.
        It returns at once in a process that does not write an arena (local ranks > 0 of a node
        copy), on a node that does not store that arena (only the node hosting rank 0 stores
        the node copy: the same step), and once a stop request has arrived (the agent persists
        right after the worker exits)."""
        if not self._writer:
            return
        if not self._agent_persists:
            self._flush_own(timeout)
            return
        if self._control is None:
            return
        from efdl import control
        try:
            self._control.request_flush(self._scope, timeout)
        except control.ControlError as e:
            raise SnapshotError("flush: %s" % e) from None

    def _flush_own(self, timeout=_FLUSH_TIMEOUT_S):
        # This process' own persister (no agent). Under the agent: nothing, since at exit,
        # SIGTERM and graceful stops the agent persists once this worker has exited; a worker
        # writing too would make two writers.
        if self._writer and not self._agent_persists:
            self._engine.flush(timeout)
            self._report_persisted()

    def _report_persisted(self):
        # Tells the node agent which step is now durable (docs/control-protocol.md): a suspend
        # records it. Only a process that writes storage knows it.
        if self._persists and self._last_step is not None and self._control is not None:
            self._control.notify_persisted(self._last_step)

    def last_persist_error(self):
        """The background persister's last failure (e.g. a full disk), or None."""
        return self._engine.last_persist_error()

    def _snapshot(self, step):
        step = int(step) if isinstance(step, int) else 0
        d = self.__dict__
        d["_shard_ctx"] = None   # the restored snapshot is no longer the newest
        with d["_lock"]:
            fast = d["_fast"]
            if fast is None or fast.commit(step, self._fast_view()) is None:
                self._snapshot_collect(step)
            d["_last_step"] = step
        if d["_control"] is not None:
            d["_control"].notify_committed(step)

    def _fast_view(self):
        """The State's parts as FastCommit reads them now (efdl._commit.fast_view)."""
        model = self._model
        return _commit.fast_view(model.obj, self._optimizer.obj, self._scheduler.obj, self._plan,
                                 model.cache, self._values)

    def _snapshot_collect(self, step):
        """The Python path of a commit: finds the tensors (or proves them unchanged), formats the
        meta text, copies; then prepares the compiled path for the next commits (_make_fast)."""
        sched_sd = self._scheduler.state_dict()
        plan = self._plan
        # The per-commit path (docs/snapshots.md, "Measured"): while the tensors come from
        # the same objects at the same addresses, nothing is collected again.
        if (plan is None or plan.fast_key is None or plan.fast_key != self._fast_key(sched_sd)
                or plan.raw_ptrs != [t.data_ptr() for t in plan.originals]):
            names, tensors, scalars = self._collect_tensors(sched_sd)
            if (plan is None or plan.key != [id(t) for t in tensors]
                    or plan.raw_ptrs != [t.data_ptr() for t in tensors]):
                plan = self._plan = _commit.make_plan(self._engine, names, tensors)
            plan.scalars = scalars
            plan.fast_key = None if scalars else self._fast_key(sched_sd)
        for i in plan.restage:
            plan.tensors[i].copy_(plan.originals[i])
        meta = self._meta(plan.scalars, sched_sd)
        fill = plan.fill if 0 in plan.ptrs else None
        self._engine.commit(plan.ptrs, step, meta, fill)
        self._make_fast(plan, sched_sd)

    def _make_fast(self, plan, sched_sd):
        """Hands the commit just taken to efdl._efdl.FastCommit, which repeats it from C++ while
        nothing it was made from changes (src/python/fast_commit.h): only for plain states (no
        scheduler, tensors in host memory, optimizer state all tensors, keyword arguments JSON
        carries exactly: what _fast_key and the cached meta describe). When four in a row were
        dropped after fewer than 4 commits (say, a learning rate set on every step), none is
        made for the next 100 commits: building one costs more than it saves then."""
        old = self._fast
        if old is not None:
            self._fast = None
            self._fast_strikes = self._fast_strikes + 1 if old.hits < 4 else 0
            if self._fast_strikes >= 4:
                self._fast_strikes = 0
                self._fast_retry = self._commits + 100
        cached = self._manifest.cache
        if (self._fast_enabled and self._commits >= self._fast_retry and cached is not None
                and sched_sd is None and plan.fast_key is not None and not plan.restage
                and 0 not in plan.ptrs):
            self._fast = _commit.make_fast_commit(self._engine, self._fast_view(), plan,
                                                  self._model.cache, cached,
                                                  self._manifest.program_field)

    def _fast_key(self, sched_sd):
        """Identities that fix the tensor list of a commit: the model's cached entries, the
        optimizer's parameters and state values, tensor-valued scheduler state and keyword
        arguments (-1 separates the parts)."""
        key = []
        self._model.fingerprint(key)
        self._optimizer.fingerprint(key)
        key.append(-1)
        self._scheduler.fingerprint(sched_sd, key)
        key.append(-1)
        self._kwargs.fingerprint(key)
        return key

    def _collect_tensors(self, sched_sd):
        """(names, tensors, {param index: non-tensor optimizer state}) of a commit; `sched_sd`:
        the scheduler's state_dict() (None without a scheduler)."""
        names, tensors, scalars = [], [], {}
        self._model.collect(names, tensors)
        self._optimizer.collect(names, tensors, scalars)
        self._scheduler.collect(sched_sd, names, tensors)
        self._kwargs.collect(names, tensors)
        return names, tensors, scalars

    def _meta(self, scalars, sched_sd):
        """The manifest's meta text (efdl._manifest); `scalars`: non-tensor optimizer state by
        parameter index, `sched_sd`: the scheduler's state_dict() or None."""
        opt = self._optimizer.obj
        shard = None
        if _shards.is_zero(opt):
            # The layout changes only with the optimizer or its groups (add_param_group)
            # (the cache holds the optimizer, so its id is not reused while it is cached)
            key = (id(opt), opt.rank, opt.world_size,
                   [(id(g["params"]), len(g["params"])) for g in opt.optim.param_groups])
            cached = self.__dict__.get("_zero_layout")
            if cached is None or cached[0] != key:
                cached = self.__dict__["_zero_layout"] = (key, _shards.layout(opt), opt)
            shard = cached[1]
        return self._manifest.text(self._values, opt, scalars, sched_sd, shard)

    # -- restore -------------------------------------------------------------------------------

    def _read(self, ref, ptrs):
        """Copies tensor i of `ref` to ptrs[i] (0: skip): from this node's engine, or from a
        snapshot received from another rank."""
        if isinstance(ref, (_agreement.ReceivedSnapshot, _shards.ComposedSnapshot)):
            ref.restore(ptrs)
        else:
            self._engine.restore(ref, ptrs)

    def _usable_meta(self, ref):
        """The unpickled metadata of `ref` when it can be restored (metadata readable; a storage
        file's checksum verified, so a corrupt one is skipped before anything is restored from
        it), else None with a warning."""
        meta = _manifest.read(ref, self._program, self._job)
        if meta is not None and ref.source == "storage":
            try:
                self._engine.restore(ref, [0] * len(ref.tensors))
            except SnapshotError as e:
                warnings.warn("efdl: skipping snapshot seq %d in %s: %s" % (ref.seq, ref.path, e))
                return None
        return meta

    def _adopt(self, ref, meta):
        """Makes `ref` the snapshot this State restores from; restores the user values now."""
        ptrs, finish = self._kwargs.prepare_restore(ref, meta, self._job)
        if ptrs:
            self._read(ref, [ptrs.get(t[0], 0) for t in ref.tensors])
        self._restored = ref
        self._restored_meta = meta
        finish()
        if "step" not in self._values and isinstance(ref.step, int):
            self.__dict__["_commit_offset"] = ref.step + 1 - self._commits
        self.__dict__["_since_snapshot"] = 0   # what it restored is a snapshot
        self._samplers.load(self._values)

    def _announce_restore(self):
        """One line on stderr (global rank 0): the snapshot this run continues from, its age and
        place, and how to start over instead - a run never continues earlier work silently."""
        ref = self._restored
        where = {"memory": "this host's memory", "peer": "another rank's memory"}.get(
            ref.source, os.path.dirname(ref.path) or ref.path)
        wall = getattr(ref, "wall_time", 0.0) or 0.0
        age = max(0.0, time.time() - wall)
        for limit, unit, div in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
            if age < limit:
                ago = "%d %s ago" % (age // div, unit)
                break
        else:
            ago = "%d days ago" % (age // 86400)
        if not wall:
            ago = "at an unknown time"
        epoch = self._values.get("epoch")
        detail = "step %d%s" % (ref.step, ", epoch %s" % epoch if isinstance(epoch, int) else "")
        # A job run with --etcd keeps its records there: its reset needs --etcd too (worker_env.cc).
        shared = _env.env_flag(Env.SHARED_ETCD, False)
        sys.stderr.write(
            "efdl: job '%s' continues from snapshot %d (%s) in %s, written %s; to start "
            "over: `efdl reset --job %s%s` first, or use another job id\n"
            % (self._job, ref.seq, detail, where, ago, self._job,
               " --etcd ..." if shared else ""))
        sys.stderr.flush()

    def _restore_newest(self):
        """Restores the user values from the newest usable snapshot and remembers it, so the
        model/optimizer/scheduler (given now or later) restore from the same one."""
        for ref in self._engine.candidates():
            meta = self._usable_meta(ref)
            if meta is None:
                continue
            try:
                self._adopt(ref, meta)
            except SnapshotError as e:
                warnings.warn("efdl: skipping snapshot seq %d in %s: %s" % (ref.seq, ref.path, e))
                continue
            return True
        return False

    def _restore_agreed(self, world):
        """_restore_newest for a round of `world` ranks: all of them restore the same snapshot,
        the newest some rank holds; ranks lacking it receive it from a holder (_agreement).
        Collective: every rank of the default group constructs its State."""
        chosen = self._agreed_snapshot(world)
        if chosen is None:
            return False
        self._adopt(chosen[0], chosen[1])
        return True

    def _agreed_snapshot(self, world):
        """The snapshot the ranks of a round of `world` agree on: (ref, meta, own_newest), where
        own_newest says it is the newest this rank offered itself, or None when no rank has one.
        The ranks that lack it receive it here. Collective over the default group."""
        import torch.distributed as dist
        self._follow_rank()
        usable = []
        for ref in self._engine.candidates():
            meta = self._usable_meta(ref)
            if meta is not None:
                usable.append((ref, meta))
                if not self._per_rank:
                    break  # only the newest counts for a node copy
        # Per-rank snapshots may be shards of a ZeroRedundancyOptimizer: every rank also offers
        # the shards it can read itself (efdl/_shards.py), which any rank may need.
        offers, local = self._sharded_offers() if self._per_rank else ([], {})
        infos = _agreement.gather(([(r.seq, r.step) for r, _ in usable], self._engine.next_seq,
                                   [tuple(o) for o in offers]), world)
        # From now on one seq names the same commit on every node of the round.
        self._engine.advance_seq(max([i[1] for i in infos] +
                                     [o[0] + 1 for i in infos for o in i[2]]))
        if any(i[2] for i in infos):
            return self._agreed_sharded(world, [i[2] for i in infos], local)
        try:
            decision = _agreement.decide([i[0] for i in infos], self._per_rank)
        except _agreement.NoCommonSnapshotError as e:
            raise SnapshotError("job %r: %s" % (self._job, e)) from None
        if decision.key is None:
            return None
        rank = dist.get_rank()
        if rank in decision.receive_from:
            src = decision.receive_from[rank]
            try:
                ref = _agreement.receive_snapshot(src)
            except RuntimeError as e:
                raise SnapshotError("job %r: receiving snapshot seq %d from rank %d failed: %s"
                                    % (self._job, decision.key[0], src, e)) from None
            meta = self._usable_meta(ref)
            if meta is None:
                raise SnapshotError("job %r: snapshot seq %d received from rank %d has unreadable "
                                    "metadata" % (self._job, decision.key[0], src))
            return ref, meta, False
        ref, meta = next(u for u in usable if (u[0].seq, u[0].step) == decision.key)
        receivers = sorted(r for r, s in decision.receive_from.items() if s == rank)
        if receivers:
            _agreement.send_snapshot(self._engine, ref, receivers)
        return ref, meta, ref is usable[0][0]

    def _restore_parts(self, parts):
        """Restores the given parts from the chosen snapshot with one engine call: every check
        (keys, shapes, counts) runs before any byte is written."""
        ref, meta = self._restored, self._restored_meta
        opt = self._optimizer.obj
        if "optimizer" in parts and _shards.is_zero(opt):
            parts = [p for p in parts if p != "optimizer"]
            # A ZeroRedundancyOptimizer of a destroyed process group (an in-process round
            # change): the program gives the new round's one, which is restored then.
            zero_now = not _shards.stale(opt)
        else:
            zero_now = False
        ptrs, finishes = {}, []
        for part in parts:
            part_ptrs, finish = getattr(self, "_" + part).prepare_restore(ref, meta, self._job)
            ptrs.update(part_ptrs)
            finishes.append(finish)
        try:
            if ptrs:
                self._read(ref, [ptrs.get(t[0], 0) for t in ref.tensors])
        except SnapshotError as e:
            raise SnapshotError("restoring the %s from snapshot seq %d (%s) failed: %s; start "
                                "over with `efdl reset --job %s` or another job id"
                                % (" and ".join(parts), ref.seq, ref.path, e, self._job)) from None
        for finish in finishes:
            finish()
        if zero_now:
            self._restore_zero()

    # -- sharded optimizer state (efdl/_shards.py) ----------------------------------------------

    def _open_engine(self, rank, local_rank):
        """The snapshot engine of this process' scope for global `rank` (__init__; again when an
        in-process round gives this process another rank: _follow_rank)."""
        settings = self._settings
        # Whose snapshot goes where (snapshot/scope.h, shared with the agent): this process'
        # arena scope ("node" or "rank<N>"), whether it writes that arena (one writer per arena:
        # local rank 0 for a node copy, every rank for per-rank copies), whether that arena goes
        # to storage (one copy per job, global rank 0's, or one per rank) and where.
        role = _efdl.snapshot_role(self._per_rank, rank, local_rank)
        self._scope = role.scope
        self._storage_dir = os.path.abspath(_efdl.store_dir(
            self._snapshot_base, self._job, self._per_rank, rank))
        self._arena_path = _efdl.arena_path(self._shm_dir, self._job, self._holder, role.scope)
        self._writer = role.writes_arena
        self._persists = role.stored and not self._agent_persists
        self._engine = _efdl.SnapshotEngine(
            self._job, role.scope, self._arena_path, self._storage_dir,
            num_slots=_env.env_int(Env.SNAPSHOT_SLOTS, _efdl.DEFAULT_SNAPSHOT_SLOTS),
            keep=settings.keep,
            persist=self._persists,
            copy_threads=_env.env_int(Env.SNAPSHOT_THREADS, 0),
            persist_min_interval_ms=settings.min_interval_ms,
            hmac_key=settings.hmac_key,
            commit_checksum=_env.env_flag(Env.COMMIT_CHECKSUM, False))

    def _follow_rank(self):
        """Per-rank snapshots under efdl.elastic.run: a process whose rank changed at an
        in-process round commits into the scope of its new rank from now on (the agent stores
        rank<N>'s arena; its old scope's snapshots stay readable for the agreement)."""
        import torch.distributed as dist
        rank = dist.get_rank()
        if not self._per_rank or "rank%d" % rank == self._scope:
            return
        old = self._engine
        if self._persists:
            old.flush()
        self._open_engine(rank, _env.local_rank())
        self._engine.advance_seq(old.next_seq)
        self.__dict__["_plan"] = None
        self.__dict__["_fast"] = None

    def _check_zero(self, optimizer):
        """A ZeroRedundancyOptimizer needs per-rank snapshots over the default group."""
        if not _shards.is_zero(optimizer):
            return
        if not self._per_rank:
            raise TypeError(
                "efdl.State holds a ZeroRedundancyOptimizer with per-rank snapshots only: each "
                "rank keeps its own shard; set EFDL_SNAPSHOT_PER_RANK=1 (under `efdl run`, in "
                "the environment of `efdl run`, so the agents store every rank's shard)")
        if _shards.stale(optimizer):
            raise TypeError(
                "efdl.State holds a ZeroRedundancyOptimizer over the default process group "
                "only: build it without process_group=, after efdl.init() (under "
                "efdl.elastic.run, inside the training function, each round)")

    def _agreement_world(self):
        """The ranks that agree on a restore: group_size(), and 1 for per-rank snapshots in a
        group of one (its shards may be of a larger world: they are resharded)."""
        world = _agreement.group_size()
        if not world and self._per_rank and _dist.is_initialized():
            return 1
        return world

    def _reader(self, old_rank):
        """An engine that reads old rank `old_rank`'s per-rank snapshots (its arena in this
        node's memory, its store); this rank's own engine for its own scope. Writes nothing."""
        if "rank%d" % old_rank == self._scope:
            return self._engine
        settings = self._settings
        return _efdl.SnapshotEngine(
            self._job, "rank%d" % old_rank,
            _efdl.arena_path(self._shm_dir, self._job, self._holder, "rank%d" % old_rank),
            os.path.abspath(_efdl.store_dir(self._snapshot_base, self._job, True, old_rank)),
            keep=settings.keep, persist=False, hmac_key=settings.hmac_key)

    def _peer_copy_reader(self, old_rank):
        """An engine that reads the copy this node's agent keeps of old rank `old_rank`'s arena
        (src/agent/peer_copy.h): its memory only. Writes nothing."""
        scope = "rank%d" % old_rank
        return _efdl.SnapshotEngine(
            self._job, scope,
            _efdl.arena_path(self._shm_dir, self._job, self._holder,
                             _efdl.peer_arena_scope(scope)),
            "", keep=self._settings.keep, persist=False, hmac_key=self._settings.hmac_key)

    def _sharded_offers(self):
        """([Offer], {(seq, step, old rank): (engine, ref, meta)}): the ZeRO shards this rank
        can read itself, each from its best source: memory, a peer copy, storage."""
        offers, local = {}, {}
        scopes = set(_shards.readable_scopes(self._shm_dir, self._job, self._holder,
                                             self._snapshot_base))
        own = _shards.scope_rank(self._scope)
        if own is not None:
            scopes.add(own)
        readers = [(self._reader(r), None) for r in sorted(scopes)]
        readers += [(self._peer_copy_reader(r), _shards.PEER_COPY)
                    for r in _shards.readable_peer_copies(self._shm_dir, self._job, self._holder)]
        for engine, kind in readers:
            for ref in engine.candidates():
                # The metadata first (no data read): a per-rank snapshot that is no shard
                # costs no checksum pass over a stored file.
                meta = _manifest.read(ref, self._program, self._job)
                shard = ((meta or {}).get("optimizer") or {}).get("shard")
                if not shard:
                    continue
                # The layout's rank (a process keeps its scope until its next agreement)
                old_rank = int(shard["rank"])
                key = (ref.seq, ref.step, old_rank)
                source = kind or ref.source
                if key in offers and (_shards.preference(offers[key].source)
                                      <= _shards.preference(source)):
                    continue   # a better copy came first
                if ref.source == "storage" and self._usable_meta(ref) is None:
                    continue   # its checksum failed (warned)
                local[key] = (engine, ref, meta)
                offers[key] = _shards.Offer(ref.seq, ref.step, old_rank, int(shard["world"]),
                                            source, tuple(shard["owned"]))
        return list(offers.values()), local

    def _agreed_sharded(self, world, offers_by_rank, local):
        """_agreed_snapshot for ZeRO shards: the newest snapshot whose old shards are all
        readable by some rank; this rank's model and keyword values come from one old shard
        (its own when it can read one, else sent by a holder without its optimizer tensors).
        Remembers the agreement for the optimizer's restore (_restore_zero). Collective."""
        import torch.distributed as dist
        # A shard missing from the newest snapshot may be on its way to storage: a node that
        # leaves gracefully has its agent store its ranks' final commit as it goes, while the
        # others pause and agree within tens of milliseconds. So the ranks look again, up to
        # _SHARD_RETRIES times _SHARD_RETRY_S apart; every rank decides from the same gathered
        # offers, so all of them look again the same number of times.
        for attempt in range(_SHARD_RETRIES + 1):
            try:
                decision = _shards.decide(
                    [[_shards.Offer(*o) for o in offers] for offers in offers_by_rank])
                missing = None
            except _shards.ShardsMissingError as e:
                decision, missing = None, e
            if (missing is None and (decision is None or decision.skipped is None)) \
                    or attempt == _SHARD_RETRIES:
                break
            time.sleep(_SHARD_RETRY_S)
            offers, local = self._sharded_offers()
            offers_by_rank = _agreement.gather([tuple(o) for o in offers], world)
        if missing is not None:
            raise SnapshotError(
                "job %r: %s; restart the lost ranks' hosts (their shared memory holds those "
                "shards), give the new ranks the snapshot store (EFDL_SNAPSHOT_DIR), or start "
                "over with `efdl reset --job %s`" % (self._job, missing, self._job)) from None
        if decision is None:
            return None
        rank = dist.get_rank()
        if decision.skipped is not None and rank == 0:
            (seq, step), missing = decision.skipped
            sys.stderr.write(
                "efdl: job '%s': snapshot seq %d (step %d) lacks the optimizer shard of old "
                "rank(s) %s (in no rank's memory, not in storage); restoring seq %d (step %d) "
                "instead\n" % (self._job, seq, step, ", ".join(map(str, missing)),
                               decision.key[0], decision.key[1]))
        seq, step = decision.key
        bases = _shards.base_of(decision, world)
        received = None
        for n in range(world):
            r, src, _ = bases[n]
            if src == n:
                continue
            try:
                if src == rank:
                    engine, ref, _ = local[(seq, step, r)]
                    _agreement.send_snapshot(engine, ref, [n],
                                             select=_shards.not_optimizer(ref.tensors))
                elif n == rank:
                    received = _agreement.receive_snapshot(src)
            except RuntimeError as e:
                raise SnapshotError("job %r: moving snapshot seq %d of old rank %d from rank %d "
                                    "to rank %d failed: %s" % (self._job, seq, r, src, n, e)
                                    ) from None
        r, src, source = bases[rank]
        if src == rank:
            _, ref, meta = local[(seq, step, r)]
        else:
            ref = received
            meta = self._usable_meta(ref)
            if meta is None:
                raise SnapshotError("job %r: snapshot seq %d received from rank %d has "
                                    "unreadable metadata" % (self._job, seq, src))
        self.__dict__["_shard_ctx"] = {"decision": decision, "local": local, "world": world,
                                       "base": (r, src, source)}
        # The model is always copied (held False): the optimizer's restore follows.
        return ref, meta, False

    def _restore_zero(self):
        """Rebuilds this rank's shard of the ZeroRedundancyOptimizer's state from the old
        shards of the agreed snapshot (efdl/_shards.py plan): pieces this rank reads itself,
        the others received from the ranks that hold them. Collective over the default group:
        every rank gives its ZeroRedundancyOptimizer at the same point."""
        import torch.distributed as dist
        zero, ref = self._optimizer.obj, self._restored
        ctx = self._shard_ctx
        shard = ((self._restored_meta or {}).get("optimizer") or {}).get("shard")
        if ctx is None or ctx["decision"].key != (ref.seq, ref.step):
            if shard is None and "optimizer" not in (self._restored_meta or {}):
                return   # nothing of an optimizer to restore: a fresh optimizer it is
            if self._restore_own_shard(zero, ref, shard):
                return
            raise SnapshotError(
                "job %r: the ZeroRedundancyOptimizer's shards of snapshot seq %d are restored "
                "when the ranks agree on it: give it to State(...) after efdl.init() or, under "
                "efdl.elastic.run, set state.optimizer inside the training function before the "
                "first commit()" % (self._job, ref.seq))
        decision, local = ctx["decision"], ctx["local"]
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != ctx["world"]:
            raise SnapshotError("job %r: the world changed (%d ranks, %d at the agreement) "
                                "before the ZeroRedundancyOptimizer was restored"
                                % (self._job, world, ctx["world"]))
        seq, step = decision.key
        mine = _shards.owned(zero)
        try:
            plan = _shards.plan(decision, _agreement.gather(mine, world))
        except _shards.ShardsMissingError as e:
            raise SnapshotError("job %r: %s" % (self._job, e)) from None
        pieces, metas = [], []
        for dst, f in _shards.transfers(plan):
            try:
                if f.src == rank:
                    engine, sref, _ = local[(seq, step, f.old_rank)]
                    _agreement.send_snapshot(engine, sref, [dst],
                                             select=_shards.optimizer_names(sref.tensors,
                                                                            f.indices))
                elif dst == rank:
                    got = _agreement.receive_snapshot(f.src)
                    meta = self._usable_meta(got)
                    if meta is None:
                        raise RuntimeError("unreadable metadata")
                    pieces.append((lambda r_, p_: r_.restore(p_), got,
                                   {e[0] for e in got.tensors}))
                    metas.append(meta)
            except RuntimeError as e:
                raise SnapshotError("job %r: moving old rank %d's optimizer shard of snapshot "
                                    "seq %d from rank %d to rank %d failed: %s"
                                    % (self._job, f.old_rank, seq, f.src, dst, e)) from None
        for f in plan[rank]:
            if f.src == rank:
                engine, sref, smeta = local[(seq, step, f.old_rank)]
                pieces.append((engine.restore, sref,
                               _shards.optimizer_names(sref.tensors, f.indices)))
                metas.append(smeta)
        meta = _shards.merge_optimizer_meta(metas or [self._restored_meta], mine)
        sources = [_shards.describe(f, rank, local[(seq, step, f.old_rank)][1].path
                                    if f.src == rank else "") for f in plan[rank]]
        composed = _shards.ComposedSnapshot(seq, step, pieces, ref.meta_json,
                                            "resharded: " + "; ".join(sources) if sources
                                            else "resharded: no parameters")
        ptrs, finish = self._optimizer.prepare_restore(composed, meta, self._job)
        try:
            composed.restore([ptrs.get(e[0], 0) for e in composed.tensors])
        except SnapshotError as e:
            raise SnapshotError("restoring the ZeroRedundancyOptimizer's shard from snapshot "
                                "seq %d failed: %s; start over with `efdl reset --job %s` or "
                                "another job id" % (seq, e, self._job)) from None
        finish()
        base_r, base_src, base_source = ctx["base"]
        base = _shards.describe(_shards.Fetch(base_r, base_src, base_source, []), rank,
                                getattr(ref, "path", ""))
        sys.stderr.write(
            "efdl: rank %d restored its ZeroRedundancyOptimizer shard (%d of %d parameters) of "
            "snapshot seq %d (step %d), written by %d ranks, for %d ranks: %s; model and values "
            "from %s\n" % (rank, len(mine), sum(len(o) for o in decision.owned.values()), seq,
                           step, decision.old_world, world,
                           ", ".join(sources) if sources else "it owns no parameters", base))
        sys.stderr.flush()

    def _restore_own_shard(self, zero, ref, shard):
        """Without an agreement (Horovod's state.restore(): back to the newest snapshot this
        node holds): restores `zero` from this rank's own shard of the same layout in `ref`
        (this rank's engine's snapshot). False when `ref` is not that."""
        if (shard is None or isinstance(ref, _agreement.ReceivedSnapshot)
                or shard != _shards.layout(zero)):
            return False
        names = _shards.optimizer_names(ref.tensors, shard["owned"])
        composed = _shards.ComposedSnapshot(ref.seq, ref.step, [(self._engine.restore, ref,
                                                                  names)],
                                            ref.meta_json, ref.path)
        meta = _shards.merge_optimizer_meta([self._restored_meta], shard["owned"])
        ptrs, finish = self._optimizer.prepare_restore(composed, meta, self._job)
        composed.restore([ptrs.get(e[0], 0) for e in composed.tensors])
        finish()
        return True

    # -- efdl/_rounds.RoundsHost: what the in-process rounds use -------------------------------

    def _round_place(self):
        # Its control client holds the place (efdl/_place.py), else the environment does.
        return _place.current(self._control)

    def _held_snapshots(self):
        for ref in self._engine.candidates():
            meta = self._usable_meta(ref)
            if meta is not None:
                yield ref, meta

    def _adopt_all(self, ref, meta):
        given = [p for p in _RESERVED_ORDER if getattr(self, p) is not None]
        self._adopt(ref, meta)
        if given:
            self._restore_parts(given)

    def _restored_step(self):
        ref = self._restored
        return None if ref is None else ref.step

    def _on_round_synced(self):
        self._samplers.load(self._values)   # deal the rest of the epoch to this round's ranks

    def _forget_stop_vote(self):
        vote = self._vote
        if vote is not None:
            vote.abandon()
        self._vote = None
        self._vote_checked = False

    # -- stopping ------------------------------------------------------------------------------

    def _connect_control(self):
        if not os.environ.get(Env.CONTROL_SOCKET):
            return None
        try:
            from efdl import control
            return control.connect_from_env()
        except Exception as e:  # noqa: BLE001 - training goes on without graceful stops
            warnings.warn("efdl: cannot reach the node agent (%s); graceful stops are off" % e)
            return None

    def _stop_now(self, step):
        """The agent asked for a graceful stop: persist, tell it, exit 0. Under
        efdl.elastic.run, anything but the agent's "stop" (its "pause", or the agreed stop of a
        peer) is a round change instead: the snapshot just taken is the state (_rounds)."""
        rounds = self._rounds
        if rounds.in_process and (self._control is None or self._control.stop_request() is None):
            rounds.pause(step)
        try:
            self._flush_own()
        except SnapshotError as e:
            sys.stderr.write("efdl: persisting the final snapshot failed: %s\n" % e)
        if self._control is not None:
            self._control.notify_stopping(step if isinstance(step, int) else 0, snapshot=True)
        raise SystemExit(0)

    def __del__(self):
        # The atexit hook only reaches States still alive at exit; the usual `state` local of a
        # main() that returns is gone by then. Its newest commit must reach storage all the same
        # (tests/faults/test_state_exit.py). Best effort, like the exit hook.
        d = self.__dict__
        if d.get("_exit_flush_pid") is None or d.get("_exit_flush_pid") != os.getpid():
            return
        try:
            self._flush_own()
            # Persisted: the exit hook removes the arena when the process exits (not now: the
            # program may go on and build a State of the same job, which restores from it).
            release = d.get("_exit_release")
            if release is not None and self._standalone_arena():
                release["lock"] = d.get("_holder_lock")
                release["ok"] = True
        except Exception as e:  # noqa: BLE001 - in a finalizer: report, do not raise
            try:
                sys.stderr.write("efdl: persisting the last snapshot failed: %s\n" % e)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def _standalone_arena(self):
        d = self.__dict__
        return (not d.get("_agent_persists") and d.get("_writer")
                and d.get("_holder_lock") is not None)

    def _release_arena(self):
        """At the exit of a standalone program, once its final snapshot is in storage (or, on a
        node that does not persist, rank 0's storage holds the same step): the arena would only
        hold memory until reboot, so it goes (docs/snapshots.md, "Arena lifecycle"). Under an
        agent the agent decides (it removes a job's arenas when the job completes or is
        suspended)."""
        if self._standalone_arena():
            _remove_arena(self._arena_path, self._shm_dir, self.__dict__, "_holder_lock")

    def _install_exit_hooks(self):
        if not self._writer:
            return
        ref = weakref.ref(self)
        owner = os.getpid()  # forked children (DataLoader workers) inherit these hooks
        self._exit_flush_pid = owner

        def flush_at_exit():
            state = ref()
            if state is not None and os.getpid() == owner:
                try:
                    state._flush_own()
                    state._release_arena()
                except Exception as e:  # noqa: BLE001 - at exit: report, do not raise
                    sys.stderr.write("efdl: persisting the last snapshot at exit failed: %s\n" % e)

        # Filled by __del__ when the State was freed after its final persist: the arena is then
        # removed at exit all the same (the usual `state` local of a main() that returned).
        release = {"ok": False, "lock": None}
        self._exit_release = release
        arena_path, shm_dir = self._arena_path, self._shm_dir

        def release_at_exit():
            if os.getpid() == owner and ref() is None and release["ok"]:
                _remove_arena(arena_path, shm_dir, release, "lock")

        atexit.register(release_at_exit)
        atexit.register(flush_at_exit)
        # SIGTERM (suspend, node shutdown): persist the newest snapshot, then exit. Only when the
        # program has not installed its own handler, and only from the main thread (Python's rule).
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                def on_sigterm(signum, frame):
                    if os.getpid() != owner:
                        signal.signal(signum, signal.SIG_DFL)
                        os.kill(os.getpid(), signum)
                        return
                    flush_at_exit()
                    raise SystemExit(128 + signum)
                signal.signal(signal.SIGTERM, on_sigterm)
