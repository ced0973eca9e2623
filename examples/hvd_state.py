"""Elastic Horovod training with State and DistributedSampler (EFDL-SPEC 3.2, 3.3, 3.5).

Run (one node, 2 processes; a private etcd is started for you):
    efdl run --nproc-per-node 2 -- /usr/bin/python3 examples/hvd_state.py
Several nodes: start `efdl etcd` once, then on each node (any number between 1 and 3, at any time)
    efdl run --etcd 127.0.0.1:2379 --job digits-hvd --nnodes 1:3 --node-id nodeA -- \
        /usr/bin/python3 examples/hvd_state.py
Kill a node, add one, or stop one with Ctrl-C: training continues from the last commit, at the
new world size, without repeating or skipping data.

The Horovod loop of the spec with its import changed to `import efdl.backend.horovod.torch as
hvd` (Horovod's API plus EFDL's State, data.DistributedSampler, exact_resume). Like
examples/train_ddp_state.py it commits (epoch+1, 0) at the end of an epoch and resumes from the
job-wide sample count (hvd.exact_resume) instead of the spec's step recomputation.
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
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--commit-interval", type=int, default=5, help="commit every N steps")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep per step (seconds), to make a tiny job last long enough to watch")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_digits_datasets()
    world = hvd.size()

    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    # Restores model, optimizer, scheduler and the counters from the newest snapshot of the job,
    # if there is one (so epoch=0 may come back as epoch=3).
    state = hvd.State(model, optimizer, scheduler, epoch=0, samples=0, total_samples=0,
                       world_size=world)
    state.set_commit_interval(args.commit_interval)
    state.world_size = world
    # Horovod's usual start: every rank takes rank 0's weights and optimizer state (the State
    # restored the same snapshot on every rank; this is what Horovod programs do anyway). The
    # optimizer is converted in place, so the State keeps snapshotting the same object.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    start = hvd.exact_resume(state.samples, args.batch_size, world)
    sampler = hvd.data.DistributedSampler(train_set, epoch=state.epoch,
                                           global_start_index=start.global_start_index)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    rank0 = hvd.rank() == 0
    if rank0:
        print("resuming at epoch %d, sample %d of the epoch, %d samples in all, world %d, round %s"
              % (state.epoch, state.samples, state.total_samples, world,
                 os.environ.get("EFDL_ROUND", "-")), flush=True)

    t_last = time.time()
    for epoch in range(state.epoch, args.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        for state.step, (data, target) in enumerate(loader, start=start.step):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            # Every rank consumed len(data) samples (the last batch may be short for all alike).
            state.samples += len(data) * world
            state.total_samples += len(data) * world
            if rank0 and state.step % args.log_interval == 0:
                now = time.time()
                print("epoch %d step %d samples %d loss %.4f world %d samples/s %.0f" %
                      (epoch, state.step, state.total_samples, loss.item(), world,
                       args.log_interval * args.batch_size * world / max(now - t_last, 1e-9)),
                      flush=True)
                t_last = now
            if args.step_delay:
                time.sleep(args.step_delay)
            state.commit()
        scheduler.step()
        # The epoch is done: record the *next* epoch at sample 0, so a restart here does not
        # train this epoch again (the spec's loop commits before advancing the epoch).
        state.epoch, state.samples, state.step = epoch + 1, 0, 0
        start = hvd.exact_resume(0, args.batch_size, world)
        state.commit()
        if rank0:
            print("epoch %d done: test accuracy %.4f" % (epoch, accuracy(model, test_set)),
                  flush=True)

    digests = hvd.allgather_object(parameters_digest(model))
    if rank0:
        print("training complete: %d samples, test accuracy %.4f; parameters %s on all %d ranks"
              % (state.total_samples, accuracy(model, test_set),
                 "identical" if len(set(digests)) == 1 else "DIFFERENT " + " ".join(digests),
                 world), flush=True)
    print("rank %d final parameters %s" % (hvd.rank(), digests[hvd.rank()]), flush=True)


if __name__ == "__main__":
    main()
