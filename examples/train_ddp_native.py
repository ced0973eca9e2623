"""Elastic torch DDP training with the native tools: torch.save / torch.load once per epoch.

Run (one node, a private etcd is started for you):
    efdl run --nproc-per-node 2 -- /usr/bin/python3 examples/train_ddp_native.py --epochs 3
Several nodes: start `efdl etcd` once, then on each node
    efdl run --etcd 127.0.0.1:2379 --job digits-native --nnodes 2:3 --node-id nodeA -- \
        /usr/bin/python3 examples/train_ddp_native.py

This is the baseline of EFDL-SPEC section 3.4's "native tools" variant: it survives restarts, but
a restart repeats the whole current epoch (the checkpoint is per epoch) and every save is a
blocking torch.save. examples/train_ddp_state.py does the same with State: cheaper and finer.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import efdl.backend.torch as efdl  # noqa: E402
from digits import DigitsCNN, accuracy, load_digits_datasets  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--save-dir", default=os.environ.get("EFDL_SNAPSHOT_DIR", "efdl-snapshots"))
    args = p.parse_args()

    efdl.init()
    torch.manual_seed(0)
    train_set, test_set = load_digits_datasets()
    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * efdl.get_world_size(), momentum=0.9)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    path = os.path.join(args.save_dir, os.environ.get("EFDL_JOB_ID", "local"), "last.pt")
    start_epoch = 0
    if os.path.exists(path):
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
    model = torch.nn.parallel.DistributedDataParallel(model)

    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=efdl.get_world_size(), rank=efdl.get_rank())
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        scheduler.step()
        if efdl.get_rank() == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, tmp)
            os.replace(tmp, path)  # a crash mid-save never leaves a torn last.pt
            print("epoch %d loss %.4f test accuracy %.3f world %d" %
                  (epoch, loss.item(), accuracy(model.module, test_set), efdl.get_world_size()),
                  flush=True)


if __name__ == "__main__":
    main()
