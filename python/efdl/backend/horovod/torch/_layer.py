"""A Horovod-API layer over torch.distributed (docs/horovod.md): `hvd` when Horovod is absent.

Covers what Horovod training programs use: init/size/rank/local_rank/local_size/cross_rank/
cross_size, DistributedOptimizer, broadcast_parameters/optimizer_state/object, allreduce,
allgather, broadcast (with the in-place and async forms), join, barrier and Compression.
Ops run on the default torch.distributed group (created by init() from the agent's env like
efdl.backend.torch.init) and, when that group is NCCL, on a gloo group for CPU tensors.

Unlike Horovod there is no background coordinator matching ops by name: every rank must issue
the same collectives in the same order (the usual case for data-parallel code; names are
accepted and ignored). Thread-safety: call from one thread per process, like torch.distributed.
"""

import contextlib
import importlib
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from efdl import _compute
from efdl.backend.horovod.torch import _group

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "poll", "synchronize", "join", "barrier",
    "broadcast_object", "allgather_object", "broadcast_parameters", "broadcast_optimizer_state",
    "DistributedOptimizer", "global_process_set",
]


class ReduceOp:
    """Horovod's reduction ops (compared by identity, printed by name)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "hvd." + self.name


Average = ReduceOp("Average")
Sum = ReduceOp("Sum")
Adasum = ReduceOp("Adasum")
Min = ReduceOp("Min")
Max = ReduceOp("Max")
Product = ReduceOp("Product")

_TORCH_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


class _ProcessSet:
    """Only the global process set exists in this layer."""

    def __repr__(self):
        return "hvd.global_process_set"


global_process_set = _ProcessSet()


class Compressor:
    """Compresses a tensor before a collective and restores it after."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    pass


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes; float16 range and precision)."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# This process' place in the round's group (init/start/shutdown): efdl/backend/horovod/torch/
# _group.py, which hvd.elastic.run uses too without this layer.
_context = _group.context
start = _group.start
shutdown = _group.shutdown
is_initialized = _group.is_initialized


def _check_process_set(process_set):
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process sets other than hvd.global_process_set are not "
                                  "supported by EFDL's Horovod layer; install Horovod for them")


def init(comm=None, process_sets=None):
    """Joins this round's process group (the agent's env, or a 1-process job). Idempotent."""
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...): MPI communicators need real Horovod with "
                                  "MPI; EFDL's layer runs over torch.distributed")
    if process_sets:
        raise NotImplementedError("hvd.init(process_sets=...) is not supported by EFDL's "
                                  "Horovod layer; install Horovod for process sets")
    start()


def size():
    return _context().size


def rank():
    return _context().rank


def local_rank():
    return _context().local_rank


def local_size():
    return _context().local_size


def cross_rank():
    return _context().cross_rank


def cross_size():
    return _context().cross_size


def is_homogeneous():
    return _context().homogeneous


def mpi_threads_supported():
    return False


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return True


def gloo_built():
    return True


def nccl_built():
    return dist.is_nccl_available()


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return torch.version.cuda is not None


def rocm_built():
    return getattr(torch.version, "hip", None) is not None


# ---- collectives -------------------------------------------------------------------------------

class _Handle:
    """An in-flight collective: `work` from torch.distributed and `finish()` giving the result."""

    def __init__(self, work, finish):
        self._work = work
        self._finish = finish
        self._result = None
        self._done = False

    def poll(self):
        return self._done or self._work is None or self._work.is_completed()

    def wait(self):
        if not self._done:
            if self._work is not None:
                t0 = time.monotonic_ns()
                self._work.wait()
                # Waiting for peers is not this rank's compute time (straggler detection).
                _compute.waited(time.monotonic_ns() - t0)
            self._result = self._finish()
            self._done = True
        return self._result


def poll(handle):
    """True when the async op behind `handle` has finished (synchronize() will not block)."""
    return handle.poll()


def synchronize(handle):
    """Waits for an async op and returns its output tensor."""
    return handle.wait()


def _resolve_op(average, op):
    if average is not None:
        if op is not None:
            raise ValueError("hvd: give either average= (deprecated) or op=, not both")
        warnings.warn("hvd.allreduce(average=...) is deprecated: use op=hvd.Average or hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    op = Average if op is None else op
    if op is Adasum:
        raise NotImplementedError("op=hvd.Adasum is not supported by EFDL's Horovod layer over "
                                  "torch.distributed; use hvd.Average or hvd.Sum, or install "
                                  "Horovod for Adasum")
    if op not in _TORCH_OPS:
        raise ValueError("hvd: unknown reduction op %r; use hvd.Average, Sum, Min, Max or "
                         "Product" % (op,))
    return op


def _scale(tensor, factor):
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.mul_(factor)
    return tensor.copy_(torch.floor(tensor.double() * factor).to(tensor.dtype))


def _allreduce_async_into(target, op, prescale_factor, postscale_factor):
    """Reduces `target` (contiguous, owned by the caller) in place; returns the handle."""
    ctx = _context()
    _scale(target, prescale_factor)
    post = postscale_factor / ctx.size if op is Average else postscale_factor
    if ctx.size == 1:
        return _Handle(None, lambda: _scale(target, post))
    work = dist.all_reduce(target, op=_TORCH_OPS[op], group=ctx.group_for(target), async_op=True)
    return _Handle(work, lambda: _scale(target, post))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts a reduction of a copy of `tensor` across ranks; synchronize(handle) returns it."""
    _check_process_set(process_set)
    op = _resolve_op(average, op)
    return _allreduce_async_into(tensor.detach().clone(memory_format=torch.contiguous_format), op,
                                 prescale_factor, postscale_factor)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction (default: average) of `tensor` over all ranks, as a new tensor."""
    compressed, cctx = compression.compress(tensor)
    handle = allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                             process_set)
    return compression.decompress(synchronize(handle), cctx)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place reduction of `tensor`; synchronize(handle) returns `tensor`."""
    _check_process_set(process_set)
    op = _resolve_op(average, op)
    if tensor.is_contiguous():
        return _allreduce_async_into(tensor.data, op, prescale_factor, postscale_factor)
    inner = _allreduce_async_into(tensor.detach().contiguous(), op, prescale_factor,
                                  postscale_factor)

    def finish():
        tensor.data.copy_(inner.wait())
        return tensor
    return _Handle(None, finish)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduces `tensor` in place across ranks and returns it."""
    synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                 process_set))
    return tensor


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor,
                      process_set) for t in tensors]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    handles = [allreduce_async_(t, average, name, op, prescale_factor, postscale_factor,
                                process_set) for t in tensors]
    return [synchronize(h) for h in handles]


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather; the result concatenates every rank's tensor along dimension 0 (the
    first dimensions may differ between ranks, the others must match)."""
    _check_process_set(process_set)
    ctx = _context()
    source = tensor.detach().contiguous()
    if source.dim() == 0:
        raise ValueError("hvd.allgather needs a tensor with at least one dimension")
    if ctx.size == 1:
        return _Handle(None, lambda: source.clone())
    group = ctx.group_for(source)
    counts = [torch.zeros(1, dtype=torch.int64, device=source.device) for _ in range(ctx.size)]
    dist.all_gather(counts, torch.tensor([source.shape[0]], device=source.device), group=group)
    counts = [int(c) for c in counts]
    longest = max(counts)
    padded = source
    if source.shape[0] < longest:
        padded = torch.zeros((longest,) + tuple(source.shape[1:]), dtype=source.dtype,
                             device=source.device)
        padded[:source.shape[0]] = source
    parts = [torch.empty_like(padded) for _ in range(ctx.size)]
    work = dist.all_gather(parts, padded, group=group, async_op=True)
    return _Handle(work, lambda: torch.cat([p[:n] for p, n in zip(parts, counts)]))


def allgather(tensor, name=None, process_set=global_process_set):
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts overwriting `tensor` with root_rank's; synchronize(handle) returns `tensor`."""
    _check_process_set(process_set)
    ctx = _context()
    if not 0 <= root_rank < ctx.size:
        raise ValueError("hvd.broadcast: root_rank=%r is not a rank of this job (size %d)" %
                         (root_rank, ctx.size))
    target = tensor.data if tensor.is_contiguous() else tensor.detach().contiguous()
    if ctx.size == 1:
        return _Handle(None, lambda: tensor)
    work = dist.broadcast(target, src=root_rank, group=ctx.group_for(target), async_op=True)

    def finish():
        if target.data_ptr() != tensor.data_ptr():
            tensor.data.copy_(target)
        return tensor
    return _Handle(work, finish)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's `tensor`, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def barrier(process_set=global_process_set):
    _check_process_set(process_set)
    ctx = _context()
    if ctx.size > 1:
        dist.barrier(group=ctx.cpu_group)


def join(device=-1):
    """Blocks until every rank has called join(); returns the rank that joined last.

    Unlike Horovod, ranks that joined do not keep serving other ranks' allreduces: every rank
    must reach join() after the same collectives (no uneven inputs).
    """
    ctx = _context()
    if ctx.size == 1:
        return 0
    ctx.join_count += 1
    # Arrival order comes from the store's atomic counter; the rank that made it reach size
    # arrived last.
    store = dist.distributed_c10d._get_default_store()
    arrived = store.add("efdl/hvd/join/%d" % ctx.join_count, 1)
    last = torch.tensor([ctx.rank if arrived == ctx.size else -1], dtype=torch.int64)
    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return int(last)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `obj` (any picklable object) on every rank."""
    _check_process_set(process_set)
    ctx = _context()
    if ctx.size == 1:
        return obj
    holder = [obj if ctx.rank == root_rank else None]
    dist.broadcast_object_list(holder, src=root_rank, group=ctx.cpu_group)
    return holder[0]


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj`, as a list indexed by rank."""
    _check_process_set(process_set)
    ctx = _context()
    if ctx.size == 1:
        return [obj]
    gathered = [None] * ctx.size
    dist.all_gather_object(gathered, obj, group=ctx.cpu_group)
    return gathered


def _buckets(tensors):
    """Tensors grouped by (device, dtype), in first-seen order: one flat collective per group."""
    groups = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites parameters with root_rank's: a state_dict, named_parameters() or parameters().

    A dict is broadcast in sorted key order, a sequence in its order; either must list the same
    tensors on every rank.
    """
    _check_process_set(process_set)
    ctx = _context()
    if isinstance(params, dict):
        tensors = [t for _, t in sorted(params.items())]
    else:
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if ctx.size == 1:
        return
    for bucket in _buckets([t.detach() for t in tensors if torch.is_tensor(t)]):
        flat = _flatten_dense_tensors(bucket)
        broadcast_(flat, root_rank)
        for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(value)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state and hyperparameters equal to root_rank's."""
    _check_process_set(process_set)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if _context().size == 1:
        return
    state = broadcast_object(optimizer.state_dict() if rank() == root_rank else None, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


# ---- DistributedOptimizer ----------------------------------------------------------------------

class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class: step() first averages gradients across ranks.

    Gradients are reduced at step() (or synchronize()) in one flat collective per (device,
    dtype), in the optimizer's parameter order, which is the same on every rank; a parameter
    without a gradient on this rank contributes zeros, as in Horovod.
    """

    def _efdl_setup(self, named_parameters, compression, backward_passes_per_step, op,
                    gradient_predivide_factor, sparse_as_dense):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(p, tuple) for p in named):
                raise ValueError("named_parameters should be a sequence of tuples (name, "
                                 "parameter), usually produced by model.named_parameters()")
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError("Parameter names in named_parameters must be unique. Found "
                                 "duplicates: %s" % ", ".join(dups))
            named_ids = {id(p) for _, p in named}
            unnamed = [i for i, p in enumerate(params) if id(p) not in named_ids]
            if unnamed:
                raise ValueError("named_parameters was specified, but one or more model "
                                 "parameters were not named (optimizer parameter positions %s)"
                                 % unnamed)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step=%r must be an integer >= 1" %
                             (backward_passes_per_step,))
        op = _resolve_op(None, op)
        if op is not Average and op is not Sum:
            raise ValueError("DistributedOptimizer: op must be hvd.Average or hvd.Sum")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._efdl_compression = compression
        self._efdl_op = op
        self._efdl_predivide = gradient_predivide_factor
        self._efdl_sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes

    def synchronize(self):
        """Reduces the gradients now (e.g. before clipping them); then call step() inside
        skip_synchronize()."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                if not self._efdl_sparse_as_dense:
                    raise NotImplementedError("sparse gradients are not supported by EFDL's "
                                              "Horovod layer: pass sparse_as_dense=True")
                p.grad = p.grad.to_dense()
        if size() > 1:
            prescale, postscale = 1.0, 1.0
            if self._efdl_op is Average:
                prescale, postscale = 1.0 / self._efdl_predivide, self._efdl_predivide
            pending = []
            for bucket in _buckets([p.grad for p in params]):
                flat, cctx = self._efdl_compression.compress(_flatten_dense_tensors(bucket))
                handle = _allreduce_async_into(flat, self._efdl_op, prescale, postscale)
                pending.append((bucket, handle, cctx))
            for bucket, handle, cctx in pending:
                flat = self._efdl_compression.decompress(handle.wait(), cctx)
                for grad, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    grad.copy_(value)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are reduced twice")
            self.synchronize()
        self._synchronized = False
        return super(_DistributedOptimizer, self).step(closure)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps `optimizer` so that step() applies gradients averaged (op=Average) or summed
    (op=Sum) over all ranks.

    The optimizer object itself is converted (its class becomes a subclass of its class), so a
    State, a scheduler or any other reference to it keeps seeing the same object and state.
    backward_passes_per_step: local backward passes accumulated before each step(); the sum is
    reduced once, as in Horovod. num_groups / groups are accepted; all gradients of one dtype
    are reduced together anyway.
    """
    _check_process_set(process_set)
    _context()
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed")
    base = optimizer.__class__
    optimizer.__class__ = type(base.__name__, (_DistributedOptimizer, base), {})
    try:
        optimizer._efdl_setup(named_parameters, compression, backward_passes_per_step, op,
                              gradient_predivide_factor, sparse_as_dense)
    except Exception:
        optimizer.__class__ = base
        raise
    _reroute_scheduler_step(optimizer)
    return optimizer


def _reroute_scheduler_step(optimizer):
    """A torch LR scheduler made before the conversion has replaced `optimizer.step` on the
    object with a wrapper that counts calls and then runs the step of the class the optimizer had
    *then*: that wrapper would skip the gradient reduction (each rank applying only its own
    gradients, the ranks drifting apart). Replace it with one that counts the same way and runs
    the distributed step."""
    patched = optimizer.__dict__.get("step")
    if patched is None:
        return
    counts = getattr(patched, "_with_counter", False)            # torch < 2.0
    tracks = getattr(patched, "_wrapped_by_lr_sched", False)     # torch >= 2.0
    if not (counts or tracks):
        warnings.warn("DistributedOptimizer: optimizer.step was replaced on the object itself; "
                      "that replacement is kept and may bypass the gradient averaging",
                      RuntimeWarning)
        return
    ref = weakref.ref(optimizer)   # as torch's wrapper: no reference cycle through the object

    def step(*args, **kwargs):
        opt = ref()
        if counts:
            opt._step_count += 1
        if tracks:
            opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    step._with_counter = counts
    step._wrapped_by_lr_sched = tracks
    optimizer.step = step


# hvd.elastic (Horovod's elastic API over efdl's in-process round changes) and its exceptions,
# imported on first use: they need efdl.State, which this layer alone does not.
_ELASTIC_NAMES = ("HorovodInternalError", "HostsUpdatedInterrupt")


def __getattr__(name):
    if name == "elastic" or name in _ELASTIC_NAMES:
        # import_module, not `from ... import elastic`: that form first asks the package for the
        # attribute, and the package's __getattr__ asks this module (a loop).
        elastic = importlib.import_module("efdl.backend.horovod.torch.elastic")
        return elastic if name == "elastic" else getattr(elastic, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
