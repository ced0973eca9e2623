"""The commit path of State below its decisions: the plan of a commit's tensors, and what the
compiled path (efdl._efdl.FastCommit, src/python/fast_commit.h) is handed.

A Plan is the tensor list of the last commit, its names, staging copies and addresses; State
keeps it while a cheap key and the data pointers are unchanged (docs/snapshots.md, "Measured").
FastCommit repeats a commit from C++ while nothing it was made from changed. What it checks
comes from two places: its constructor's arguments (make_fast_commit) and a dict given at its
creation and to every commit (fast_view), which holds the State's parts as they are now.
"""

import ctypes

import torch

from efdl import _efdl
from efdl._parts import dtype_name


class Plan:
    """The tensors of the last commit: names, objects and addresses. Rebuilt when they change.

    `fast_key` (State._fast_key) describes where the tensors came from; while it and the data
    pointers are unchanged, a commit reuses the plan without collecting the tensors again.
    None: every commit collects (the optimizer state holds non-tensor values, which may change
    in place)."""

    __slots__ = ("key", "names", "tensors", "ptrs", "raw_ptrs", "originals", "restage",
                 "fast_key", "scalars")

    def __init__(self, names, tensors):
        self.names = names
        self.tensors = tensors
        self.raw_ptrs = None
        # 0: not host memory, filled through fill() (device-to-host into the arena)
        self.ptrs = [0 if t.is_cuda else t.data_ptr() for t in tensors]
        self.key = [id(t) for t in tensors]
        self.restage = ()    # indexes of non-contiguous originals, copied to tensors[i] per commit
        self.fast_key = None
        self.scalars = {}

    def fill(self, index, address):
        """The engine's callback for tensors not in host memory (ptrs[index] == 0): copies
        device-to-host straight into the arena slot at `address`."""
        t = self.tensors[index]
        view = _host_view(address, t.numel() * t.element_size(), t.dtype, t.shape)
        view.copy_(t.detach())
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)


def _host_view(address, nbytes, dtype, shape):
    """A CPU tensor over `nbytes` of memory at `address` (arena memory owned by the engine)."""
    buf = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def make_plan(engine, names, tensors):
    """A Plan of the collected tensors; sets `engine`'s layout to it. Non-contiguous host
    tensors get a staging copy, refreshed from the original on every commit (plan.restage)."""
    staged, restage = [], []
    for i, t in enumerate(tensors):
        if not t.is_cuda and not t.is_contiguous():
            t = t.contiguous()
            restage.append(i)
        staged.append(t)
    plan = Plan(names, staged)
    plan.restage = tuple(restage)
    plan.key = [id(t) for t in tensors]
    plan.raw_ptrs = [t.data_ptr() for t in tensors]
    plan.originals = tensors  # keeps the ids in plan.key from being reused
    engine.set_layout([(n, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
                       for n, t in zip(names, staged)])
    return plan


def fast_view(model, optimizer, scheduler, plan, model_cache, values):
    """The dict FastCommit reads at its creation and at every commit: exactly the keys
    src/python/fast_commit.cc looks up (the names State's attributes had when it was written).

    model, optimizer, scheduler: the State's objects (None when not given); plan: the Plan of its
    last commit; model_cache: the model part's cached entries; values: the keyword arguments'
    dict. Made anew for each call, so it shows the parts as they are then; FastCommit reads it
    and does not keep it."""
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "_plan": plan,
            "_model_cache": model_cache, "_values": values}


def make_fast_commit(engine, view, plan, model_cache, meta_cache, program_field):
    """A FastCommit repeating the commit of `plan` just taken, or None for a state it does not
    cover. `view`: fast_view() now; `meta_cache`: the MetaWriter's (fingerprint, pickle) of that
    commit; `program_field`: the tail of its meta text."""
    try:
        return _efdl.FastCommit(engine, view, plan, plan.originals, plan.ptrs, model_cache,
                                meta_cache[0], meta_cache[1], torch.Tensor, program_field)
    except _efdl.SnapshotError:
        return None  # a state it does not cover: the Python path it is
