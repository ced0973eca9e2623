#!/bin/sh
# A third-party launcher inside EFDL (EFDL-SPEC section 6): torchrun starts this node's workers.
#
# Run (one node, a private etcd is started for you; torchrun starts the 2 workers):
#     efdl run --launcher --nproc-per-node 2 -- examples/launcher_torchrun.sh --epochs 1
# Several nodes, after `efdl etcd` once; on each node (a node may die or be replaced):
#     efdl run --etcd ETCD:2379 --job tr --nnodes 2 --nproc-per-node 2 --launcher -- \
#         examples/launcher_torchrun.sh
#
# `efdl run --launcher` starts this script once per node (not once per GPU) with the node-level
# values NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT (fresh every round),
# WORLD_SIZE (all processes) and RANK (this node's first global rank). On a round change the agent
# stops the whole process group, torchrun and its workers, and starts the script again with the
# new values; torchrun itself is not elastic here (--max_restarts 0: any worker failure ends it,
# and EFDL makes the new round). Arguments are passed on to the training program.
#
# Debian 12's torchrun (torch 1.13 on Python 3.11) crashes at start parsing its own default
# `--redirects 0` (AttributeError: 'NoneType' object has no attribute 'get'); in this repository
# the script therefore runs the same torchrun through bench/elastic/torchrun_py311.py, which fixes
# only that lookup. Set TORCHRUN to choose another, e.g. TORCHRUN=torchrun.
set -eu
here="$(dirname "$0")"
TRAIN="${EFDL_TRAIN_SCRIPT:-$here/train_ddp_state.py}"
if [ -z "${TORCHRUN:-}" ]; then
  if [ -f "$here/../bench/elastic/torchrun_py311.py" ]; then
    TORCHRUN="/usr/bin/python3 $here/../bench/elastic/torchrun_py311.py"
  else
    TORCHRUN=torchrun
  fi
fi
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec $TORCHRUN --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --max_restarts 0 \
    "$TRAIN" "$@"
