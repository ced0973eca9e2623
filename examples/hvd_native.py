"""Elastic Horovod training with the native tools: torch.save / torch.load once per epoch.

Run (one node, 2 processes; a private etcd is started for you):
    efdl run --nproc-per-node 2 -- /usr/bin/python3 examples/hvd_native.py --epochs 3
Several nodes: start `efdl etcd` once, then on each node (any number between 1 and 3, at any time)
    efdl run --etcd 127.0.0.1:2379 --job digits-hvd-native --nnodes 1:3 --node-id nodeA -- \
        /usr/bin/python3 examples/hvd_native.py

A Horovod program of the usual shape (EFDL-SPEC 3.5) where only the import changed:
`import efdl.backend.horovod.torch as hvd` instead of `import horovod.torch as hvd`. With Horovod
installed, `hvd` is real Horovod and meets its peers through the rendezvous the agent serves;
without it, EFDL's Horovod-API layer over torch.distributed (docs/horovod.md).

This is the baseline: it survives restarts, but a restart repeats the whole current epoch (the
checkpoint is per epoch) and every save is a blocking torch.save. examples/hvd_state.py does the
same with State: cheaper and finer.
"""

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import efdl.backend.horovod.torch as hvd  # noqa: E402
from digits import DigitsCNN, accuracy, load_digits_datasets  # noqa: E402


def parameters_digest(model):
    """A short digest of every parameter's bytes: equal on every rank when they train in step."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep per step (seconds), to make a tiny job last long enough to watch")
    p.add_argument("--save-dir", default=os.environ.get("EFDL_SNAPSHOT_DIR", "efdl-snapshots"))
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_digits_datasets()
    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    # Rank 0 reads the checkpoint (a shared directory); broadcasts give it to the others.
    path = os.path.join(args.save_dir, os.environ.get("EFDL_JOB_ID", "local"), "hvd-last.pt")
    start_epoch = 0
    if hvd.rank() == 0 and os.path.exists(path):
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scheduler.load_state_dict(hvd.broadcast_object(scheduler.state_dict(), root_rank=0))
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    if hvd.rank() == 0:
        print("starting at epoch %d, world %d, round %s" %
              (start_epoch, hvd.size(), os.environ.get("EFDL_ROUND", "-")), flush=True)

    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for step, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            if hvd.rank() == 0 and step % args.log_interval == 0:
                print("epoch %d step %d loss %.4f world %d" % (epoch, step, loss.item(),
                                                              hvd.size()), flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
        scheduler.step()
        if hvd.rank() == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            torch.save({"epoch": epoch + 1, "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, tmp)
            os.replace(tmp, path)  # a crash mid-save never leaves a torn checkpoint
            print("epoch %d done: test accuracy %.4f world %d" %
                  (epoch, accuracy(model, test_set), hvd.size()), flush=True)

    digests = hvd.allgather_object(parameters_digest(model))
    if hvd.rank() == 0:
        print("training complete: test accuracy %.4f; parameters %s on all %d ranks"
              % (accuracy(model, test_set),
                 "identical" if len(set(digests)) == 1 else "DIFFERENT " + " ".join(digests),
                 hvd.size()), flush=True)
    print("rank %d final parameters %s" % (hvd.rank(), digests[hvd.rank()]), flush=True)


if __name__ == "__main__":
    main()
