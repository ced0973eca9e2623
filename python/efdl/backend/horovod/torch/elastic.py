"""hvd.elastic on EFDL's Horovod layer: Horovod's elastic API over efdl's in-process round
changes (efdl.backend.torch.elastic; docs/horovod.md, "Elastic programs").

A Horovod elastic program written from Horovod's documentation runs under `efdl run` with only
its import changed (`import efdl.backend.horovod.torch as hvd`):

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    @hvd.elastic.run
    def train(state): ...      # state.commit() every few batches
    train(state)

What differs from Horovod, and why:
- TorchState is an efdl.State: commit() snapshots into the node's shared memory (persisted by
  the agent), and a TorchState constructed in a new process restores the job's newest snapshot,
  so the job also survives the loss of every process (Horovod's state lives only in memory).
- sync() makes the ranks agree on the newest snapshot some rank holds (newcomers receive it),
  where Horovod broadcasts rank 0's; after a round change both give every rank the same state.
- The reset callbacks run after that agreement (Horovod runs them just before its sync).
- ElasticSampler.record_batch() records the batch of every rank, not only this one's: then
  nothing a lost rank trained since the epoch began is trained again after a crash (Horovod
  gathers each surviving rank's own records).
- HorovodInternalError is what Horovod raises for a failed collective; the layer's collectives
  raise torch's RuntimeError, which hvd.elastic.run recognises as well.
"""

import functools
import math
import random

import torch

from efdl import _agreement, _dist, _progress
from efdl._rounds import RoundChangeInterrupt
from efdl.backend.horovod.torch import _group
from efdl.backend.torch import elastic as _elastic
from efdl.state import State

__all__ = ["run", "State", "TorchState", "ObjectState", "ElasticSampler",
           "HorovodInternalError", "HostsUpdatedInterrupt"]


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer is gone. hvd.elastic.run goes back to the last commit and
    continues in the next round."""

    efdl_collective_failure = True


class HostsUpdatedInterrupt(RoundChangeInterrupt):
    """Raised by commit() / check_host_updates() when the job's hosts changed; the snapshot of
    the current state is taken (skip_sync is accepted for Horovod's signature)."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


def run(func):
    """Horovod's hvd.elastic.run: calls func(state) again after every round change, in the same
    process (efdl.backend.torch.elastic.run, with this layer's init and shutdown)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return _elastic.run_rounds(func, state, args, kwargs, start_group=_group.start,
                                   stop_group=_group.shutdown)
    return wrapper


def _size():
    return _dist.world_size()


def _rank():
    return _dist.rank()


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler: deals the samples of the epoch not yet processed to the current
    ranks; record_batch() marks what was trained, set_epoch() starts a new epoch. The record is
    a tensor (one flag per sample) that TorchState snapshots with the rest of the state."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed = torch.zeros(len(dataset), dtype=torch.bool)
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = int(epoch)
        self.processed.zero_()   # in place: TorchState snapshots this very tensor
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Marks batch `batch_idx` (of `batch_size` samples per rank, counted since the sampler
        was last reset) as trained, on every rank's share."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices):
        indices = list(indices)
        if indices:
            self.processed[torch.as_tensor(indices, dtype=torch.long)] = True

    def get_indices(self, batch_idx, batch_size):
        """The dataset indices of batch `batch_idx` on every rank."""
        lo = batch_idx * batch_size
        hi = min(lo + batch_size, self.num_samples)
        n = self.num_replicas
        out = []
        for r in range(n):   # rank r's k-th sample is _order[r + k * n]: O(batch), per batch
            out.extend(self._order[r + lo * n:r + hi * n:n])
        return out

    def state_dict(self):
        return {"epoch": self.epoch,
                "processed_indices": set(self.processed.nonzero().flatten().tolist())}

    def load_state_dict(self, state_dict):
        self.epoch = int(state_dict["epoch"])
        self.processed.zero_()
        self.record_indices(state_dict["processed_indices"])
        self.reset()

    def reset(self):
        """Deals what is left of the epoch to the ranks of the current round."""
        self.num_replicas = _size()
        self.rank = _rank()
        remaining = (~self.processed).nonzero().flatten().tolist()
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.num_samples = int(math.ceil(len(remaining) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        if remaining:
            while len(remaining) < self.total_size:   # pad, as torch's sampler does
                remaining += remaining[:self.total_size - len(remaining)]
        self._order = remaining
        self.indices = remaining[self.rank:self.total_size:self.num_replicas]

    def __iter__(self):
        return _progress.counted(self.indices)

    def __len__(self):
        return self.num_samples


class TorchState(State):
    """Horovod's TorchState(model, optimizer, **kwargs) as an efdl.State: keyword values are
    attributes; an ElasticSampler given as one is snapshotted with the rest (efdl/_parts.py,
    SamplerPart; see the module docstring for what differs from Horovod). Built on State's
    hooks for subclasses (efdl/state.py) and its in-process rounds (efdl/_rounds.py)."""

    _sampler_kinds = (ElasticSampler,)

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__(model, optimizer, None, **kwargs)

    def _round_change(self, step):
        return HostsUpdatedInterrupt(False)

    def commit(self):
        """Snapshots the state (every call) and raises HostsUpdatedInterrupt when the job's
        hosts changed (every rank at the same call)."""
        return State.commit(self)

    def save(self):
        """Snapshots the state without checking for host updates."""
        self._save()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt (after a snapshot) when the job's hosts changed; every
        rank must call it as often as the others, as commit()."""
        self._check_stop()

    def restore(self):
        """Goes back to the newest snapshot this node holds."""
        self._rounds.restore_held()

    def sync(self):
        """Every rank takes the same state: the newest snapshot some rank holds (collective)."""
        if _agreement.group_size():
            self._rounds.sync()

    def on_reset(self):
        self._rounds.run_reset_callbacks()


# Horovod's names for the state classes a program may use.
ObjectState = TorchState
