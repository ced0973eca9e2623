#!/bin/sh
# Run by Slurm on each node after its `efdl run` ended, however it ended (srun --task-epilog in
# digits.sbatch): removes this node's shared-memory snapshot arenas that no live process holds,
# which an agent stopped by a signal (scancel, a failed node's step) leaves for a restart on the
# same node. Also those of other EFDL jobs on the node whose agents are gone (docs/slurm.md).
exec "${EFDL:-efdl}" snapshots gc >/dev/null
