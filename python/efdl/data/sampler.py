"""DistributedSampler with a resume point (docs/data-and-resume.md).

The model. For an epoch, the *epoch order* P is a permutation of range(N) that depends only on
(seed, epoch, N) - torch.randperm seeded with seed + epoch, or range(N) without shuffle - and not
on the world size. torch's DistributedSampler deals P out round-robin: rank r of W gets positions
r, r + W, r + 2W, ... of P, padded (cyclically from the start of P) to a multiple of W, or
truncated to one when drop_last. So after every rank has taken s samples, exactly the first s * W
positions of P are consumed, whatever the rank: a per-rank count and a global count are the same
thing at a fixed world size, and the global count is what survives a change of world size.

This sampler keeps the resume point as a *global* position G in P (`global_start_index`):
positions [0, G) were consumed by the job (all ranks together) and the rest, P[G:N], is dealt out
round-robin to the current `num_replicas` ranks with torch's padding / truncation rules. With
G = 0 it yields exactly torch's sampler; with G = s * num_replicas rank r yields torch's list for
rank r minus its first s entries.

`start_index` is the spec's per-rank value: samples THIS rank has already consumed in the epoch
at the current world size, i.e. `state.step * batch_size` (G = start_index * num_replicas).

Not thread-safe: use a sampler from one thread (the training loop; DataLoader iterates the sampler
in the main process).
"""

import math

import torch
from torch.utils.data import Sampler

from efdl import _dist, _progress


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError("DistributedSampler: %s=%r must be an integer >= %d" %
                         (name, value, minimum))
    return value


class DistributedSampler(Sampler):
    """torch.utils.data.DistributedSampler with a resume point that survives resizes.

    num_replicas / rank default to efdl.get_world_size() / efdl.get_rank() (1 and 0 without
    init(), so it also works in a single process). `epoch` seeds the shuffle (seed + epoch) as in
    torch. `start_index`: samples this rank already consumed in `epoch` (per rank, the spec's
    `state.step * batch_size`); `global_start_index`: samples the whole job already consumed in
    `epoch` - the exact resume point after a change of world size (see efdl.resume). Give at most
    one of the two.

    The resume point applies to the current epoch only: it is reset to 0 by set_epoch() with a
    different epoch and when an iteration runs to its end, so later epochs are complete.
    len() is the number of samples the next iteration yields (the skip included).
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False, epoch=0, start_index=0, global_start_index=None):
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, -2**63)
        self.drop_last = bool(drop_last)
        self.num_replicas = 1
        self.rank = 0
        self.epoch = 0
        self.global_start_index = 0
        if global_start_index is not None and start_index not in (0, None):
            raise ValueError("DistributedSampler: give start_index (per rank) or "
                             "global_start_index (whole job), not both")
        self.update(start_index=None if global_start_index is not None else start_index,
                    epoch=epoch,
                    num_replicas=_dist.world_size() if num_replicas is None else num_replicas,
                    rank=_dist.rank() if rank is None else rank,
                    global_start_index=global_start_index)

    def update(self, start_index=None, epoch=None, num_replicas=None, rank=None,
               global_start_index=None):
        """Moves the sampler; arguments left None keep their value.

        Changing only num_replicas / rank keeps the global resume point, so the data the job has
        consumed stays consumed. `start_index` is per rank at the (new) num_replicas.
        """
        if start_index is not None and global_start_index is not None:
            raise ValueError("DistributedSampler.update: give start_index (per rank) or "
                             "global_start_index (whole job), not both")
        new_replicas = self.num_replicas if num_replicas is None else \
            _check_int("num_replicas", num_replicas, 1)
        new_rank = self.rank if rank is None else _check_int("rank", rank, 0)
        if new_rank >= new_replicas:
            raise ValueError("DistributedSampler: rank=%d must be below num_replicas=%d" %
                             (new_rank, new_replicas))
        new_epoch = self.epoch if epoch is None else _check_int("epoch", epoch, 0)
        if start_index is not None:
            new_start = _check_int("start_index", start_index, 0) * new_replicas
        elif global_start_index is not None:
            new_start = _check_int("global_start_index", global_start_index, 0)
        else:
            new_start = self.global_start_index
        self.num_replicas, self.rank, self.epoch = new_replicas, new_rank, new_epoch
        self.global_start_index = new_start

    def set_epoch(self, epoch):
        """Like torch's; a different epoch also drops the resume point (a new epoch is whole)."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.global_start_index = 0
        self.epoch = epoch

    @property
    def start_index(self):
        """The resume point per rank at the current num_replicas (rounded down)."""
        return self.global_start_index // self.num_replicas

    @property
    def num_samples(self):
        """Samples per rank in a whole epoch at the current num_replicas (torch's num_samples)."""
        return self._count(0)

    @property
    def total_size(self):
        return self.num_samples * self.num_replicas

    def _count(self, start):
        remaining = len(self.dataset) - start
        if remaining <= 0:
            return 0
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def __len__(self):
        return self._count(self.global_start_index)

    def epoch_order(self):
        """P: the epoch's order of dataset indices, independent of the world size."""
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=generator).tolist()
        return list(range(n))

    def indices(self):
        """The indices this rank yields next, as a list (what __iter__ yields)."""
        order = self.epoch_order()
        start = self.global_start_index
        per_rank = self._count(start)
        if per_rank == 0:
            return []
        dealt = per_rank * self.num_replicas
        remaining = order[start:]
        padding = dealt - len(remaining)
        if padding > 0:
            # torch pads from the start of the epoch order, cycling when it is shorter.
            remaining += (order * math.ceil(padding / len(order)))[:padding]
        return remaining[self.rank:dealt:self.num_replicas]

    def __iter__(self):
        # The indices are fixed when the pass starts, as in torch's sampler.
        return self._pass(self.indices(), self.epoch, self.global_start_index)

    def _pass(self, indices, epoch, start):
        yield from _progress.counted(indices)
        # Ran to the end: the resumed epoch is done, a further pass over it is a whole one
        # (unless the resume point was moved during the pass).
        if (self.epoch, self.global_start_index) == (epoch, start):
            self.global_start_index = 0
