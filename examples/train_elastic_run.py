"""The spec's State program written with efdl.elastic.run: round changes without restarts.

Run it as train_ddp_state.py (one node: `efdl run --nproc-per-node 2 -- /usr/bin/python3
examples/train_elastic_run.py`; several: the same command with --etcd/--job/--nnodes on each
node). When a node joins, leaves or crashes, the workers of the other nodes keep their processes:
the next commit() (or, after a crash, the failed collective) interrupts `train`, the process group
is rebuilt for the new round, the ranks agree on the state, and `train` is called again, here in
the same process. Newcomers start as usual and receive the state from a rank that holds it.
docs/user-guide.md, "Recovery without restart".
"""

import argparse
import os
import sys
import time

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
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--commit-interval", type=int, default=5, help="commit every N steps")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep per step (seconds), to make a tiny job last long enough to watch")
    p.add_argument("--save-model", default="", help="write the final model's state_dict here")
    args = p.parse_args()

    torch.manual_seed(0)
    train_set, test_set = load_digits_datasets()
    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    # Restores from the newest snapshot this node holds; elastic.run then makes all ranks of
    # each round agree on one (the model is the unwrapped module).
    state = efdl.State(model, optimizer, scheduler, epoch=0, samples=0, total_samples=0,
                       world_size=1)
    state.set_commit_interval(args.commit_interval)

    def on_reset():
        # Called after every in-process round change once the state is agreed (and in a
        # worker that joins a running job).
        state.world_size = efdl.get_world_size()

    state.register_reset_callbacks([on_reset])

    @efdl.elastic.run
    def train(state):
        world = efdl.get_world_size()
        state.world_size = world
        ddp = torch.nn.parallel.DistributedDataParallel(state.model)   # per round
        start = efdl.exact_resume(state.samples, args.batch_size, world)
        sampler = efdl.data.DistributedSampler(train_set, epoch=state.epoch,
                                               global_start_index=start.global_start_index)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        rank0 = efdl.get_rank() == 0
        if rank0:
            print("resuming at epoch %d, sample %d of the epoch, %d samples in all, world %d, "
                  "round %s" % (state.epoch, state.samples, state.total_samples, world,
                                os.environ.get("EFDL_ROUND", "-")), flush=True)
        t_last = time.time()
        for epoch in range(state.epoch, args.epochs):
            state.epoch = epoch
            sampler.set_epoch(epoch)
            for state.step, (data, target) in enumerate(loader, start=start.step):
                optimizer.zero_grad()
                loss = F.cross_entropy(ddp(data), target)
                loss.backward()
                optimizer.step()
                state.samples += len(data) * world
                state.total_samples += len(data) * world
                if rank0 and state.step % args.log_interval == 0:
                    now = time.time()
                    print("epoch %d step %d samples %d loss %.4f world %d samples/s %.0f" %
                          (epoch, state.step, state.total_samples, loss.item(), world,
                           args.log_interval * args.batch_size * world / max(now - t_last,
                                                                              1e-9)),
                          flush=True)
                    t_last = now
                if args.step_delay:
                    time.sleep(args.step_delay)
                state.commit()
            scheduler.step()
            state.epoch, state.samples, state.step = epoch + 1, 0, 0
            start = efdl.exact_resume(0, args.batch_size, world)
            state.commit()
            if rank0:
                print("epoch %d done: test accuracy %.4f" % (epoch, accuracy(state.model,
                                                                              test_set)),
                      flush=True)
        return rank0

    if train(state):
        acc = accuracy(state.model, test_set)
        print("training complete: %d samples, test accuracy %.4f" % (state.total_samples, acc),
              flush=True)
        if args.save_model:
            torch.save(state.model.state_dict(), args.save_model)


if __name__ == "__main__":
    main()
