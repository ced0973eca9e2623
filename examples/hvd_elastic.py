"""A Horovod elastic program (hvd.elastic, as in Horovod's documentation) on the digits data set.

Run (one node, 2 processes; a private etcd is started for you):
    efdl run --nproc-per-node 2 -- /usr/bin/python3 examples/hvd_elastic.py
Several nodes: start `efdl etcd` once, then on each node (any number between 1 and 3)
    efdl run --etcd 127.0.0.1:2379 --job digits-hvd-elastic --nnodes 1:3 --node-id nodeA -- \
        /usr/bin/python3 examples/hvd_elastic.py
When a node joins, leaves or crashes, the workers of the other nodes keep their processes:
commit() raises HostsUpdatedInterrupt (or a collective fails), hvd.elastic.run rebuilds the
process group, the ranks agree on the state, the reset callback rescales the learning rate and
train() runs again. Only the import differs from a Horovod program: `import efdl.backend.horovod.torch
as hvd` (EFDL's Horovod layer; docs/horovod.md, "Elastic programs").
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import efdl.backend.horovod.torch as hvd  # noqa: E402
from digits import DigitsCNN, accuracy, load_digits_datasets  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--base-lr", type=float, default=0.01, help="learning rate per rank")
    p.add_argument("--batches-per-commit", type=int, default=5)
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_digits_datasets()
    model = DigitsCNN()
    optimizer = optim.SGD(model.parameters(), lr=args.base_lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    def on_state_reset():
        # Horovod's usual reset callback: the learning rate follows the number of ranks.
        for group in optimizer.param_groups:
            group["lr"] = args.base_lr * hvd.size()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler,
                                   epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        if hvd.rank() == 0:
            print("round %s: %d ranks, epoch %d, %d samples of it trained"
                  % (os.environ.get("EFDL_ROUND", "-"), hvd.size(), state.epoch,
                     int(sampler.processed.sum())), flush=True)
        for state.epoch in range(state.epoch, args.epochs):
            for state.batch, (data, target) in enumerate(loader):
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
                state.train_sampler.record_batch(state.batch, args.batch_size)
            if hvd.rank() == 0:
                print("epoch %d done: test accuracy %.4f" % (state.epoch,
                                                             accuracy(model, test_set)),
                      flush=True)
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print("training complete: test accuracy %.4f" % accuracy(model, test_set), flush=True)


if __name__ == "__main__":
    main()
