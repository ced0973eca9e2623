"""Data tools: `efdl.data.DistributedSampler` (torch's sampler plus skip and reshard)."""

from efdl.data.sampler import DistributedSampler

__all__ = ["DistributedSampler"]
