"""A worker written with efdl.elastic.run for the end-to-end tests of in-process round changes.

A linear model trained with SGD on fixed synthetic data; every step uses the same global batch
of WORKER_GLOBAL_BATCH samples (12: divisible by every world size up to 4), split evenly over
the ranks, so the parameters after step S do not depend on how many ranks computed them (up to
float rounding in the all-reduce). A run with nodes joining, leaving and crashing must therefore
end with the parameters of an uninterrupted single-process run (REFERENCE=1, no agent).

One line per step, before its commit:
    STEP round=R rank=r world=W step=S pid=P params=<sum of the parameters, 9 digits>
and at the end, on every rank:
    FINAL rank=r pid=P steps=N params=[...]
Environment: WORKER_STEPS (default 300), WORKER_STEP_TIME (seconds per step, 0.03),
WORKER_MODE (restart: the loop without efdl.elastic.run, State built after efdl.init()),
WORKER_DEVICE (cpu; cuda: the model and batches on this process' first visible GPU, so
efdl.elastic.run builds NCCL groups), WORKER_RAISE ("RANK:STEP": that rank raises ValueError at
that step, every time it gets there, as a bug in the program would; "any:STEP": whatever rank
this process holds, for a fault given to one node only), WORKER_EXIT0 ("RANK:STEP": that rank
returns from the program with status 0 at that step, once per job: WORKER_MARK_DIR),
WORKER_SLOW_TEARDOWN (seconds: the process's exit takes that much longer after its process
group is gone, as a big model's teardown does).
"""

import atexit
import json
import os
import sys
import time

if os.environ.get("WORKER_SLOW_TEARDOWN"):
    # Registered first, so it runs last: after efdl's own exit hook destroyed the process group
    # (its peers' collectives have failed by then) and before the process is gone.
    atexit.register(time.sleep, float(os.environ["WORKER_SLOW_TEARDOWN"]))

import torch
import torch.nn.functional as F

import efdl.backend.torch as efdl

import fault_marks

STEPS = int(os.environ.get("WORKER_STEPS", "300"))
STEP_TIME = float(os.environ.get("WORKER_STEP_TIME", "0.03"))
GLOBAL_BATCH = int(os.environ.get("WORKER_GLOBAL_BATCH", "12"))
DEVICE = torch.device("cuda", 0) if os.environ.get("WORKER_DEVICE") == "cuda" else None

torch.manual_seed(0)
DATA = torch.randn(240, 8)
TARGET = DATA @ torch.randn(8, 4) + 0.1 * torch.randn(240, 4)


def params_of(model):
    return [round(float(v), 6) for p in model.parameters() for v in p.detach().flatten()]


def rank_step(text):
    """(rank, step) of "RANK:STEP"; rank None for "any"."""
    if not text:
        return None
    rank, step = text.split(":")
    return (None if rank == "any" else int(rank), int(step))


def hits(fault, rank, step):
    return fault is not None and fault[1] == step and fault[0] in (None, rank)


RAISE = rank_step(os.environ.get("WORKER_RAISE"))
EXIT0 = rank_step(os.environ.get("WORKER_EXIT0"))


def once(name):
    return fault_marks.once(os.environ.get("WORKER_MARK_DIR"), name)


def main():
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4)
    if DEVICE is not None:
        model = model.to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    restart_path = os.environ.get("WORKER_MODE") == "restart"
    if restart_path:
        efdl.init()   # the spec's order: the group first, then State agrees on the snapshot
    state = efdl.State(model, optimizer, step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(efdl.get_world_size())])

    def train(state):
        ddp = torch.nn.parallel.DistributedDataParallel(
            state.model, device_ids=None if DEVICE is None else [DEVICE.index])
        world, rank = efdl.get_world_size(), efdl.get_rank()
        per_rank = GLOBAL_BATCH // world
        while state.step < STEPS:
            if hits(RAISE, rank, state.step):
                raise ValueError("a bug in the program at step %d" % state.step)
            if hits(EXIT0, rank, state.step) and once("exit0"):
                print("EXITING0 rank=%d step=%d" % (rank, state.step), flush=True)
                sys.exit(0)
            start = (state.step * GLOBAL_BATCH) % len(DATA)
            rows = torch.arange(start + rank * per_rank, start + (rank + 1) * per_rank) % len(DATA)
            optimizer.zero_grad()
            x, y = DATA[rows], TARGET[rows]
            if DEVICE is not None:
                x, y = x.to(DEVICE), y.to(DEVICE)
            F.mse_loss(ddp(x), y).backward()
            optimizer.step()
            # Printed before the commit: at a pause, commit() raises once the snapshot is taken.
            print("STEP round=%s rank=%d world=%d step=%d pid=%d params=%.9f resets=%d"
                  % (os.environ.get("EFDL_ROUND", "0"), rank, world, state.step, os.getpid(),
                     sum(params_of(state.model)), len(resets)), flush=True)
            time.sleep(STEP_TIME)
            state.step += 1
            state.commit()
        return rank

    # WORKER_MODE=restart: the same loop without the decorator (the restart path).
    rank = train(state) if restart_path else efdl.elastic.run(train)(state)
    print("FINAL rank=%d pid=%d steps=%d params=%s" % (rank, os.getpid(), state.step,
                                                        json.dumps(params_of(state.model))),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
