"""A torchrun-style program with its own checkpoint that resumes only when told (like nanoGPT's
--init_from=resume): nothing EFDL-specific.

    python3 own_checkpoint_worker.py --ckpt PATH --steps N [--resume]

init_process_group("gloo") from the launcher's env://, a DDP model, one step every
WORKER_STEP_TIME seconds (default 0.1); rank 0 saves {step, model, optimizer} to PATH (temp file
then rename) after every step. Without --resume it starts at step 0 whatever PATH holds (and
overwrites it); with --resume it loads PATH and fails when there is none. One line per step:

    STEP round=R rank=r world=W step=S

(R is EFDL_ROUND, for the tests' bookkeeping only), and "START rank=r step=S resume=0|1" once.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if args.resume:
        if not os.path.exists(args.ckpt):
            sys.exit("--resume: no checkpoint at %s" % args.ckpt)
        ckpt = torch.load(args.ckpt)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
    print("START rank=%d step=%d resume=%d" % (rank, step, int(args.resume)), flush=True)
    ddp = DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(1000 * rank + step)
    step_time = float(os.environ.get("WORKER_STEP_TIME", "0.1"))
    round_ = os.environ.get("EFDL_ROUND", "0")
    while step < args.steps:
        loss = ddp(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"step": step, "model": model.state_dict(),
                        "optimizer": opt.state_dict()}, tmp)
            os.replace(tmp, args.ckpt)
        print("STEP round=%s rank=%d world=%d step=%d" % (round_, rank, world, step), flush=True)
        time.sleep(step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
