"""The parts of a State, one handler per kind of value: the model, the optimizer, the scheduler,
the keyword arguments and samplers (SamplerPart, at the end: it keeps its samplers' progress in
the keyword values).

Each handler holds its object (`obj`, None when not given; the keyword arguments' dict for
KwargsPart) and what is derived from it, and does for its part what State orchestrates:
 - collect(...): the part's tensors of a commit (names, tensors), in snapshot order:
   "model/<state_dict key>", "optimizer/<param index>/<state key>", "scheduler/<key>",
   "kw/<name>"; non-tensor values go to the meta text (efdl._manifest);
 - fingerprint(key): appends the identities that fix the part's tensor list (State._fast_key:
   while they and the data pointers are unchanged, a commit reuses its plan);
 - prepare_restore(ref, meta, job): checks the snapshot against the object (keys, shapes,
   counts: SnapshotMismatchError) and returns ({tensor name: destination address}, finish):
   State reads every part's tensors with one engine call, then calls each finish().
"""

import torch

from efdl import _shards


class SnapshotMismatchError(ValueError):
    """A snapshot does not fit the objects it should be restored into (keys, shapes, counts)."""


# Public as efdl.state.SnapshotMismatchError (State's API): named so in tracebacks and pickles.
SnapshotMismatchError.__module__ = "efdl.state"


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def dtype_of(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotMismatchError("snapshot holds a tensor of unknown dtype %r" % name)
    return dtype


def mismatch(ref, job, what):
    return SnapshotMismatchError(
        "snapshot seq %d of job %r (%s) does not match: %s. It was written by another "
        "program or model under the same job id; restore into the model/optimizer it was "
        "taken from, or start over: `efdl reset --job %s` (it moves the snapshots aside), or "
        "another job id (--job / EFDL_JOB_ID)" % (ref.seq, job, ref.path, what, job))


def destinations(entries, reuse=None):
    """CPU tensors to receive the given (name, dtype, shape, nbytes) entries of a snapshot: those
    in `reuse` (by name) when CPU, contiguous and of the same dtype/shape (no allocation: fresh
    memory costs a page fault per 4 KiB), else new ones. Returns ({name: tensor},
    {name: address})."""
    out, ptrs = {}, {}
    reuse = reuse or {}
    for name, dtype, shape, _ in entries:
        t = reuse.get(name)
        if (t is None or t.device.type != "cpu" or not t.is_contiguous()
                or dtype_name(t.dtype) != dtype or list(t.shape) != list(shape)):
            t = torch.empty(shape, dtype=dtype_of(dtype))
        out[name] = t
        ptrs[name] = t.data_ptr()
    return out, ptrs


# -- what State refuses ------------------------------------------------------------------------
#
# State snapshots replicated state: every rank holds the same model and optimizer state, a commit
# copies the tensors of model.state_dict() and of optimizer.state, and any rank's snapshot
# restores any rank of any world size. State refuses, at State(...) and at the setters, what that
# cannot restore correctly across a world-size change (docs/user-guide.md, "Which models and
# optimizers State holds"), with one TypeError line:
#  - a sharded optimizer other than torch's ZeroRedundancyOptimizer (which State holds with
#    per-rank snapshots and reshards at a world-size change: efdl/_shards.py): any optimizer with
#    a mark of sharding (a method of _SHARDING_METHODS: fairscale's OSS, say), and a
#    ZeroRedundancyOptimizer built with overlap_with_ddp=True;
#  - an object that is not a torch.optim.Optimizer (State knows no other optimizer's state:
#    DeepSpeed's ZeRO optimizers, say), or one that keeps its state in another optimizer it wraps
#    (an attribute that is a torch.optim.Optimizer with a `state` of its own: State would
#    snapshot only the wrapper's);
#  - a model that is or contains an FSDP module, and a model or optimizer whose parameters are
#    sharded tensors (_SHARDED_TENSORS: FSDP's flat parameters, DTensor, ShardedTensor).
# Classes are recognised by name in the object's class hierarchy, not by import: torch's fsdp
# package does not even import in some builds (Debian's 1.13 on Python 3.11), and nothing is
# imported to check an object that cannot be one.

_SHARDING_METHODS = ("consolidate_state_dict", "_partition_parameters", "partition_parameters")
_SHARDED_MODULES = frozenset(("FullyShardedDataParallel", "FSDPModule"))
_SHARDED_TENSORS = frozenset(("FlatParameter", "DTensor", "ShardedTensor"))
_SUPPORTED = ("State snapshots and restores replicated state (every rank the same, any world "
              "size: a torch.optim optimizer over the plain model with DistributedDataParallel) "
              "and torch's ZeroRedundancyOptimizer with EFDL_SNAPSHOT_PER_RANK=1 "
              "(docs/user-guide.md, \"Which models and optimizers State holds\")")


def _class_named(obj, names):
    """The name of the first class in type(obj)'s hierarchy named one of `names`, else None."""
    for cls in type(obj).__mro__:
        if cls.__name__ in names:
            return cls.__name__
    return None


def _a(name):
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _refused(what, why):
    return TypeError("efdl.State cannot hold %s: %s; %s" % (what, why, _SUPPORTED))


def check_model(model):
    """Raises TypeError when State cannot restore `model` across a world-size change."""
    if not isinstance(model, torch.nn.Module):
        return   # State takes any object with a state_dict(); only a module is checked here
    for name, module in model.named_modules():
        cls = _class_named(module, _SHARDED_MODULES)
        if cls is not None:
            where = "a model wrapped in %s" % cls if not name else \
                "a model whose submodule %r is %s" % (name, _a(cls))
            raise _refused(where, "each rank holds only its shard of the parameters and "
                                  "their state")
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        cls = _class_named(tensor, _SHARDED_TENSORS)
        if cls is not None:
            raise _refused("a model whose %r is %s" % (name, _a(cls)),
                           "each rank holds only its shard of it")


def check_optimizer(optimizer):
    """Raises TypeError when State cannot restore `optimizer` across a world-size change."""
    if optimizer is None:
        return
    kind = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise _refused(_a(kind), "it is not a torch.optim.Optimizer, so State does not know "
                                 "where its state is or whether ranks share it")
    if _shards.is_zero(optimizer):
        why = _shards.unsupported_zero(optimizer)
        if why is not None:
            raise _refused(_a(kind), why)
        return
    for method in _SHARDING_METHODS:
        if callable(getattr(optimizer, method, None)):
            raise _refused(_a(kind), "it shards the optimizer state (it has %s()): each rank "
                                     "holds only its shard, and after a world-size change a "
                                     "rank's old shard is not the one the new layout gives it"
                           % method)
    for group in optimizer.param_groups:
        for p in group["params"]:
            cls = _class_named(p, _SHARDED_TENSORS)
            if cls is not None:
                raise _refused("%s over %s parameters" % (_a(kind), cls),
                               "each rank holds only its shard of these parameters and of "
                               "their optimizer state")
    for attr, value in getattr(optimizer, "__dict__", {}).items():
        if isinstance(value, torch.optim.Optimizer) and value.state is not optimizer.state:
            raise _refused(_a(kind), "it keeps optimizer state in the %s it wraps (attribute "
                                     "%r), which State does not snapshot"
                           % (type(value).__name__, attr))


class ModelPart:
    """The model (the unwrapped module, not DDP): the tensors of its state_dict(keep_vars=True)."""

    __slots__ = ("obj", "cache", "split")

    def __init__(self, model=None):
        self.set(model)

    def set(self, model):
        check_model(model)
        self.obj = model
        self.cache = None   # [("model/<key>", tensor)], made once per model: entries()
        self.split = None   # (cache it was made from, names, tensors): collect()

    def entries(self):
        cache = self.cache
        if cache is None:
            sd = self.obj.state_dict(keep_vars=True)
            cache = [("model/" + k, v) for k, v in sd.items() if isinstance(v, torch.Tensor)]
            self.cache = cache
        return cache

    def collect(self, names, tensors):
        if self.obj is None:
            return
        split = self.split
        if split is None or split[0] is not self.cache:
            entries = self.entries()
            split = (entries, [n for n, _ in entries], [t for _, t in entries])
            self.split = split
        names.extend(split[1])
        tensors.extend(split[2])

    def fingerprint(self, key):
        key.append(id(self.cache) if self.obj is not None else 0)

    def prepare_restore(self, ref, meta, job):
        saved = [(n[len("model/"):], d, s, b) for n, d, s, b in ref.tensors
                 if n.startswith("model/")]
        current = [(k[len("model/"):], t) for k, t in self.entries()]
        if not saved:
            raise mismatch(ref, job, "the snapshot holds no model state but a model was given")
        saved_keys = {s[0] for s in saved}
        current_keys = {k for k, _ in current}
        for key, _ in current:
            if key not in saved_keys:
                raise mismatch(ref, job, "model key %r is missing from the snapshot" % key)
        for key, *_ in saved:
            if key not in current_keys:
                raise mismatch(ref, job, "snapshot key %r is not in the model" % key)
        by_name = dict(current)
        for key, dtype, shape, _ in saved:
            t = by_name[key]
            if list(t.shape) != list(shape):
                raise mismatch(ref, job, "model key %r has shape %s in the snapshot but %s in "
                                         "the model" % (key, list(shape), list(t.shape)))
            if dtype_name(t.dtype) != dtype:
                raise mismatch(ref, job, "model key %r has dtype %s in the snapshot but %s in "
                                         "the model" % (key, dtype, dtype_name(t.dtype)))
        ptrs, copies = {}, []
        for key, dtype, shape, _ in saved:
            t = by_name[key]
            if t.device.type == "cpu" and t.is_contiguous():
                ptrs["model/" + key] = t.data_ptr()  # straight into the parameter's memory
            else:
                tmp = torch.empty(shape, dtype=dtype_of(dtype))
                copies.append((t, tmp))
                ptrs["model/" + key] = tmp.data_ptr()

        def finish():
            with torch.no_grad():
                for t, tmp in copies:
                    t.copy_(tmp)
        return ptrs, finish


class OptimizerPart:
    """The optimizer: its state's tensors by parameter index (the order of its param_groups);
    its hyper-parameters and non-tensor state travel in the meta text."""

    __slots__ = ("obj", "param_cache")

    def __init__(self, optimizer=None):
        self.set(optimizer)

    def set(self, optimizer):
        check_optimizer(optimizer)
        self.obj = optimizer
        self.param_cache = None   # see param_index

    def params(self):
        params = []
        for group in self.obj.param_groups:
            params.extend(group["params"])
        return params

    def param_index(self):
        """({id(param): index in the optimizer's param_groups}, name cache), rebuilt when the
        optimizer or its groups change."""
        opt = self.obj
        key = [id(opt)]
        for g in opt.param_groups:
            key += (id(g["params"]), len(g["params"]))
        cached = self.param_cache
        if cached is None or cached[0] != key:
            index = {id(p): i for i, p in enumerate(self.params())}
            cached = self.param_cache = (key, index, {})
        return cached[1], cached[2]

    def collect(self, names, tensors, scalars):
        """Appends the state's tensors; `scalars` gets the non-tensor state by parameter index.

        On the path of every commit, so: one pass over the optimizer state, iterated rather than
        looked up (a lookup hashes the parameter through Python-level Tensor.__hash__), and each
        name formatted once."""
        if self.obj is None:
            return
        index, opt_names = self.param_index()
        for p, s in _shards.local_state(self.obj).items():
            i = index.get(id(p))
            if i is None or not s:
                continue
            for key, v in s.items():
                if isinstance(v, torch.Tensor):
                    name = opt_names.get((i, key))
                    if name is None:
                        name = opt_names[(i, key)] = "optimizer/%d/%s" % (i, key)
                    names.append(name)
                    tensors.append(v)
                else:
                    scalars.setdefault(i, {})[key] = v

    def fingerprint(self, key):
        opt = self.obj
        if opt is not None:
            key.append(id(opt))
            key += [(id(g["params"]), len(g["params"])) for g in opt.param_groups]
            key.append(-1)
            key += [id(x) for p, st in _shards.local_state(opt).items()
                    for x in (p, *st.values())]

    def _existing_buffers(self, params):
        """Optimizer state tensors that already exist, by snapshot name: restored in place."""
        out = {}
        state = _shards.local_state(self.obj)
        for i, p in enumerate(params):
            for key, v in (state.get(p) or {}).items():
                if isinstance(v, torch.Tensor):
                    out["optimizer/%d/%s" % (i, key)] = v
        return out

    def prepare_restore(self, ref, meta, job):
        saved = meta.get("optimizer")
        if saved is None:
            raise mismatch(ref, job, "the snapshot holds no optimizer state but an optimizer "
                                     "was given")
        opt = self.obj
        groups = saved["param_groups"]
        if len(groups) != len(opt.param_groups):
            raise mismatch(ref, job, "the optimizer has %d parameter groups, the snapshot %d"
                           % (len(opt.param_groups), len(groups)))
        for i, (g, sg) in enumerate(zip(opt.param_groups, groups)):
            if len(g["params"]) != sg["num_params"]:
                raise mismatch(ref, job, "optimizer parameter group %d has %d parameters, the "
                                         "snapshot's %d" % (i, len(g["params"]), sg["num_params"]))
        params = self.params()
        entries = [e for e in ref.tensors if e[0].startswith("optimizer/")]
        for name, dtype, shape, _ in entries:
            index = int(name.split("/")[1])
            if index >= len(params):
                raise mismatch(ref, job, "snapshot tensor %r refers to parameter %d of %d"
                               % (name, index, len(params)))
        zero = _shards.is_zero(opt)
        # A ZeroRedundancyOptimizer gets the state of the parameters it owns (the snapshot is
        # composed of those: efdl/_shards.py), into the optimizer it wraps.
        mine = set(_shards.owned(opt)) if zero else None
        if zero:
            for name, *_ in entries:
                if int(name.split("/")[1]) not in mine:
                    raise mismatch(ref, job, "snapshot tensor %r is not of this rank's shard"
                                   % name)
        tensors, ptrs = destinations(entries, self._existing_buffers(params))

        def finish():
            new_state = {}
            for i, small in saved.get("state", {}).items():
                if mine is not None and int(i) not in mine:
                    continue
                new_state.setdefault(int(i), {}).update(small)
            for name, t in tensors.items():
                _, index, key = name.split("/", 2)
                p = params[int(index)]
                if t.is_floating_point() and key != "step":
                    t = t.to(dtype=p.dtype)
                new_state.setdefault(int(index), {})[key] = t.to(device=p.device)
            target = _shards.local_state(opt)
            target.clear()
            for index, st in new_state.items():
                target[params[index]] = st
            group_lists = [opt.param_groups] + ([opt.optim.param_groups] if zero else [])
            for group_list in group_lists:
                for g, sg in zip(group_list, groups):
                    for k, v in sg.items():
                        if k != "num_params":
                            g[k] = v
        return ptrs, finish


class SchedulerPart:
    """The learning-rate scheduler: the tensors of its state_dict(); the rest travels in the meta
    text. State takes its state_dict() once per commit and hands it to collect and fingerprint."""

    __slots__ = ("obj",)

    def __init__(self, scheduler=None):
        self.set(scheduler)

    def set(self, scheduler):
        self.obj = scheduler

    def state_dict(self):
        return self.obj.state_dict() if self.obj is not None else None

    @staticmethod
    def collect(sched_sd, names, tensors):
        if sched_sd is not None:
            for key, v in sched_sd.items():
                if isinstance(v, torch.Tensor):
                    names.append("scheduler/" + key)
                    tensors.append(v)

    @staticmethod
    def fingerprint(sched_sd, key):
        if sched_sd is not None:
            key += [id(v) for v in sched_sd.values() if isinstance(v, torch.Tensor)]

    def prepare_restore(self, ref, meta, job):
        saved = meta.get("scheduler")
        if saved is None:
            raise mismatch(ref, job, "the snapshot holds no scheduler state but a scheduler "
                                     "was given")
        entries = [e for e in ref.tensors if e[0].startswith("scheduler/")]
        tensors, ptrs = destinations(entries)

        def finish():
            sd = dict(saved)
            for name, t in tensors.items():
                sd[name[len("scheduler/"):]] = t
            self.obj.load_state_dict(sd)
        return ptrs, finish


class KwargsPart:
    """The keyword arguments (epoch, step, ...: user values, State's attributes): tensor-valued
    ones are snapshot tensors, the others travel in the meta text."""

    __slots__ = ("obj",)

    def __init__(self, values):
        self.obj = values   # the dict itself, never replaced (State reads it as _values)

    def collect(self, names, tensors):
        for key, v in self.obj.items():
            if isinstance(v, torch.Tensor):
                names.append("kw/" + key)
                tensors.append(v)

    def fingerprint(self, key):
        key += [(k, id(v)) for k, v in self.obj.items() if isinstance(v, torch.Tensor)]

    def prepare_restore(self, ref, meta, job):
        """Restores every keyword argument of the snapshot (all of them: the program's own values
        are replaced, others added), never a mismatch."""
        entries = [t for t in ref.tensors if t[0].startswith("kw/")]
        tensors, ptrs = destinations(entries) if entries else ({}, {})

        def finish():
            values = dict(meta.get("kwargs", {}))
            for name, t in tensors.items():
                values[name[len("kw/"):]] = t
            self.obj.update(values)
        return ptrs, finish


class SamplerPart:
    """Samplers given as keyword arguments (hvd.elastic.ElasticSampler; State takes the types its
    class lists in `_sampler_kinds`, none for efdl.State): each one's record of the samples
    trained (`processed`, one bool per sample) and its epoch travel as the keyword values
    efdl_sampler_<name>_processed and _epoch; after a restore or a round change the samplers take
    them back and deal what is left of the epoch to the current ranks (their reset())."""

    __slots__ = ("obj",)

    def __init__(self, samplers=None):
        self.obj = dict(samplers or {})   # {keyword: sampler}

    @staticmethod
    def keys(name):
        return "efdl_sampler_%s_processed" % name, "efdl_sampler_%s_epoch" % name

    def save(self, values):
        """Puts every sampler's record and epoch into the keyword values (before a snapshot)."""
        for name, sampler in self.obj.items():
            processed, epoch = self.keys(name)
            values[processed] = sampler.processed
            values[epoch] = sampler.epoch

    def load(self, values):
        """The samplers take the record and epoch the keyword values hold (after a restore)."""
        for name, sampler in self.obj.items():
            processed, epoch = self.keys(name)
            record = values.get(processed)
            if isinstance(record, torch.Tensor) and record.shape == sampler.processed.shape:
                sampler.processed = record
            sampler.epoch = int(values.get(epoch, sampler.epoch))
            sampler.reset()
