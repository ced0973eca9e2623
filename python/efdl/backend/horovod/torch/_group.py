"""This process' place in the round's group under EFDL's Horovod layer: what hvd.init() learns
(rank, size, local and cross ranks, the gloo group for CPU tensors) and its start and end.

Its own module so that both users of it import it, neither the other: the layer's collectives
(_layer.py, which offers `hvd.elastic` lazily) and hvd.elastic.run (elastic.py, which starts
and ends a group each round). The package then has no import cycle
(tests/python/test_import_cycles.py).
"""

import torch
import torch.distributed as dist

from efdl import _dist, _env
from efdl._names import Env


class _Context:
    """What init() learned about this process's place in the job; replaced on every init()."""

    def __init__(self, owns_default_group):
        self.owns_default_group = owns_default_group
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.local_rank = _env.launcher_int(Env.HOROVOD_LOCAL_RANK, _env.local_rank())
        self.local_size = _env.launcher_int(Env.HOROVOD_LOCAL_SIZE, _env.local_world_size(),
                                            minimum=1)
        # NCCL only moves CUDA tensors; CPU tensors (counters, objects) go through gloo.
        self.cpu_group = None
        if dist.get_backend() != "gloo":
            self.cpu_group = dist.new_group(backend="gloo")
        self.join_count = 0
        layout = [torch.zeros(2, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(layout, torch.tensor([self.local_rank, self.local_size]),
                        group=self.cpu_group)
        local_ranks = [int(t[0]) for t in layout]
        # Horovod's cross communicator joins the processes with the same local rank, one per
        # node; the agent numbers ranks node by node, so global order is node order.
        peers = [r for r, lr in enumerate(local_ranks) if lr == self.local_rank]
        self.cross_rank = _env.launcher_int(Env.HOROVOD_CROSS_RANK, peers.index(self.rank))
        self.cross_size = _env.launcher_int(Env.HOROVOD_CROSS_SIZE, len(peers), minimum=1)
        self.homogeneous = len({int(t[1]) for t in layout}) == 1

    def group_for(self, tensor):
        return self.cpu_group if not tensor.is_cuda else None


# The process' one membership, as torch.distributed's default group is: set by start(), cleared
# by shutdown().
_ctx = None


def context():
    if _ctx is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _ctx


def start(timeout=None, backend=None):
    """init() with efdl.backend.torch.init()'s options for the process group it may create."""
    global _ctx
    if _ctx is not None and dist.is_initialized():
        return
    owns = not dist.is_initialized()
    _dist.init_process_group(timeout=timeout, backend=backend)
    _ctx = _Context(owns_default_group=owns)


def shutdown():
    """Leaves the group (destroying it if init() created it). Collectives fail until init()."""
    global _ctx
    if _ctx is None:
        return
    ctx, _ctx = _ctx, None
    if ctx.cpu_group is not None:
        dist.destroy_process_group(ctx.cpu_group)
    if ctx.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized():
    return _ctx is not None
