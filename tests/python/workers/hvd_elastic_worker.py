"""A Horovod elastic program written from Horovod's documentation, with only the import changed
(`import efdl.backend.horovod.torch as hvd` instead of `import horovod.torch as hvd`).

hvd.elastic.TorchState with an ElasticSampler, a commit every WORKER_COMMIT_EVERY batches
(default 4), a reset callback that scales the learning rate with hvd.size(). One line per batch:
    HSTEP round=R rank=r size=S epoch=E batch=B lr=L pid=P params=<sum> processed=N
and, at the end of each epoch on rank 0, EPOCH epoch=E processed=N of M; at the end FINAL.
Environment: WORKER_EPOCHS (default 6), WORKER_STEP_TIME (0.02).
"""

import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import efdl.backend.horovod.torch as hvd

EPOCHS = int(os.environ.get("WORKER_EPOCHS", "6"))
STEP_TIME = float(os.environ.get("WORKER_STEP_TIME", "0.02"))
COMMIT_EVERY = int(os.environ.get("WORKER_COMMIT_EVERY", "4"))
BATCH = 4
BASE_LR = 0.01

hvd.init()
torch.manual_seed(0)
x = torch.randn(480, 8)
dataset = TensorDataset(x, x @ torch.randn(8, 4))
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.5)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def on_state_reset():
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * hvd.size()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler,
                               epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        for batch_idx, (data, target) in enumerate(loader):
            state.batch = batch_idx
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            optimizer.zero_grad()
            F.mse_loss(model(data), target).backward()
            optimizer.step()
            state.train_sampler.record_batch(batch_idx, BATCH)
            print("HSTEP round=%s rank=%d size=%d epoch=%d batch=%d lr=%g pid=%d params=%.9f "
                  "processed=%d" % (os.environ.get("EFDL_ROUND", "0"), hvd.rank(), hvd.size(),
                                    state.epoch, batch_idx, optimizer.param_groups[0]["lr"],
                                    os.getpid(), float(sum(p.sum() for p in model.parameters())),
                                    int(sampler.processed.sum())), flush=True)
            time.sleep(STEP_TIME)
        if hvd.rank() == 0:
            print("EPOCH epoch=%d processed=%d of %d" % (state.epoch, int(sampler.processed.sum()),
                                                          len(dataset)), flush=True)
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
print("FINAL rank=%d pid=%d epoch=%d" % (hvd.rank(), os.getpid(), state.epoch), flush=True)
