"""An elastic Horovod program in the style of Horovod's documentation and examples, written for
Horovod and run unmodified (`import horovod.torch as hvd`) under `efdl run --horovod`: local
synthetic data instead of a download, CPU only. Nothing EFDL-specific.

Like Horovod's elastic examples it builds its torch DistributedSampler (num_replicas=hvd.size())
and DataLoader once, before hvd.elastic.run; --sampler-per-round builds them inside the training
function instead, once per round. One line per batch:

    HSTEP round=R rank=r size=S epoch=E batch=B pid=P params=<sum> replicas=N

(R is EFDL_ROUND, for the tests' bookkeeping only) and FINAL rank=r pid=P at the end.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
import torch.utils.data.distributed
import horovod.torch as hvd

parser = argparse.ArgumentParser(description="elastic Horovod training on synthetic data")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--step-time", type=float, default=0.05)
parser.add_argument("--sampler-per-round", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

x = torch.randn(384, 10)
train_dataset = torch.utils.data.TensorDataset(x, x @ torch.randn(10, 2))


def make_loader():
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    return sampler, torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                                sampler=sampler)


train_sampler, train_loader = make_loader()
model = torch.nn.Linear(10, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none, op=hvd.Average)


@hvd.elastic.run
def train(state):
    sampler, loader = (make_loader() if args.sampler_per_round
                       else (train_sampler, train_loader))
    for state.epoch in range(state.epoch, args.epochs + 1):
        state.model.train()
        sampler.set_epoch(state.epoch)
        steps_remaining = len(loader) - state.batch
        for state.batch, (data, target) in enumerate(loader):
            if state.batch >= steps_remaining:
                break
            state.optimizer.zero_grad()
            loss = F.mse_loss(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            print("HSTEP round=%s rank=%d size=%d epoch=%d batch=%d pid=%d params=%.9f "
                  "replicas=%d" % (os.environ.get("EFDL_ROUND", "0"), hvd.rank(), hvd.size(),
                                   state.epoch, state.batch, os.getpid(),
                                   float(sum(p.sum() for p in model.parameters())),
                                   sampler.num_replicas), flush=True)
            time.sleep(args.step_time)
            state.commit()
        state.batch = 0


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
print("FINAL rank=%d pid=%d" % (hvd.rank(), os.getpid()), flush=True)
