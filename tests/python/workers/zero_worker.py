"""A ZeroRedundancyOptimizer(Adam) program under efdl.State, for the end-to-end tests of sharded
optimizer state (issue #35; tests/python/test_e2e_zero.py).

A small MLP in DDP, a global batch of 12 at every step whatever the world size (split evenly
over the ranks: 12 is divisible by 1..4), a commit every step. Two ways, as a user writes them:
WORKER_MODE=restart: efdl.init(), then State(model, zero) (restored at construction);
WORKER_MODE=inprocess: State(model) before efdl.elastic.run; inside the training function
(every round) a new ZeroRedundancyOptimizer over the round's group, given with
state.optimizer = zero (restored then).

One line per step, after the optimizer step and before its commit:
    STEP round=R rank=r world=W step=S pid=P
and at the end, on every rank:
    FINAL {"rank": r, "step": S, "shard": {global index: [step, exp_avg, exp_avg_sq]},
           "params": [...]}
Environment: WORKER_STEPS (default 60), WORKER_STEP_TIME (seconds per step, 0.1).
"""

import json
import os
import time

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

import efdl.backend.torch as efdl

STEPS = int(os.environ.get("WORKER_STEPS", "60"))
STEP_TIME = float(os.environ.get("WORKER_STEP_TIME", "0.1"))
BATCH = 12

_data = torch.Generator().manual_seed(1)
X = torch.randn(BATCH * STEPS, 16, generator=_data)
Y = torch.randint(0, 4, (BATCH * STEPS,), generator=_data)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))


def make_zero(model):
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)


def loop(state, zero):
    rank, world = efdl.get_rank(), efdl.get_world_size()
    ddp = torch.nn.parallel.DistributedDataParallel(state.model)
    per = BATCH // world
    round_ = os.environ.get("EFDL_ROUND", "0")
    while state.step < STEPS:
        lo = state.step * BATCH + rank * per
        loss = torch.nn.functional.cross_entropy(ddp(X[lo:lo + per]), Y[lo:lo + per])
        zero.zero_grad()
        loss.backward()
        zero.step()
        state.step += 1
        print("STEP round=%s rank=%d world=%d step=%d pid=%d"
              % (round_, rank, world, state.step, os.getpid()), flush=True)
        state.commit()
        time.sleep(STEP_TIME)
    index = {id(p): i for i, p in enumerate(state.model.parameters())}
    shard = {index[id(p)]: [int(s["step"]), s["exp_avg"].flatten().tolist(),
                            s["exp_avg_sq"].flatten().tolist()]
             for p, s in zero.optim.state.items()}
    params = [p.detach().flatten().tolist() for p in state.model.parameters()]
    print("FINAL " + json.dumps({"rank": rank, "step": state.step, "shard": shard,
                                 "params": params}), flush=True)
    return rank


def main():
    if os.environ.get("WORKER_MODE", "restart") == "restart":
        efdl.init(timeout=60)
        model = make_model()
        zero = make_zero(model)
        state = efdl.State(model, zero, step=0)
        loop(state, zero)
        return
    state = efdl.State(make_model(), step=0)

    @efdl.elastic.run
    def train(state):
        zero = make_zero(state.model)
        state.optimizer = zero   # restores this rank's shard of the agreed snapshot
        return loop(state, zero)

    train(state)


if __name__ == "__main__":
    main()
