"""A plain DDP training program, as a user would write it for torchrun: nothing EFDL-specific.

init_process_group("gloo") with no arguments (env://: MASTER_ADDR, RANK, ... from the
launcher), a small model in DistributedDataParallel, SGD on random data; one line per step:

    STEP round=R rank=r world=W step=S

(R is EFDL_ROUND, for the tests' bookkeeping only), after one line with what the network setup
came from: NET rank=r MASTER_ADDR=... GLOO_SOCKET_IFNAME=... NCCL_SOCKET_IFNAME=... WORKER_STEP_TIME: seconds per step
(default 0.2); WORKER_STEPS: steps before exiting 0 (default 0: until stopped).
"""

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    round_ = int(os.environ.get("EFDL_ROUND", "0"))
    step_time = float(os.environ.get("WORKER_STEP_TIME", "0.2"))
    steps = int(os.environ.get("WORKER_STEPS", "0"))
    print("NET rank=%d MASTER_ADDR=%s GLOO_SOCKET_IFNAME=%s NCCL_SOCKET_IFNAME=%s" % (
        rank, os.environ.get("MASTER_ADDR"), os.environ.get("GLOO_SOCKET_IFNAME"),
        os.environ.get("NCCL_SOCKET_IFNAME")), flush=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    step = 0
    while steps == 0 or step < steps:
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("STEP round=%d rank=%d world=%d step=%d" % (round_, rank, world, step), flush=True)
        step += 1
        time.sleep(step_time)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
