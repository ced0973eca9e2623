"""A plain torch DDP program, as written for torchrun: no efdl import at all.

`torch.distributed.init_process_group("gloo")` from the launcher's environment, the digits CNN of
examples/digits.py on torch's own DistributedSampler, and a checkpoint with torch.save by rank 0
every --ckpt-every steps into --ckpt-dir, loaded at start when present (the usual torchrun
recipe: a restart resumes from the last checkpoint). It runs unchanged under `efdl run` and
torchrun; bench/elastic/back_to_back.py measures both.

Rank 0 prints one line per step:
    STEP world=W step=S samples=N t=UNIX_TIME
where `samples` counts the samples trained since the job began, as restored from the
checkpoint (so a restart that repeats steps shows it going back).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
from digits import DigitsCNN, load_digits_datasets  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=20)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    train_set, _ = load_digits_datasets()
    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(args.ckpt_dir, "checkpoint.pt")
    epoch, step, samples = 0, 0, 0
    if os.path.exists(path):
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch, step, samples = ckpt["epoch"], ckpt["step"], ckpt["samples"]
    model = torch.nn.parallel.DistributedDataParallel(model)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            step += 1
            samples += len(data) * world
            if rank == 0:
                print("STEP world=%d step=%d samples=%d t=%.6f" % (world, step, samples,
                                                                   time.time()), flush=True)
                if step % args.ckpt_every == 0:
                    tmp = path + ".tmp"
                    torch.save({"model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(), "epoch": epoch,
                                "step": step, "samples": samples}, tmp)
                    os.replace(tmp, path)
            if args.step_delay:
                time.sleep(args.step_delay)
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
