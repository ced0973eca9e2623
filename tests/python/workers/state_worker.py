"""An elastic training worker with efdl.State for the end-to-end tests (digits, DDP over gloo).

Trains a small MLP on the digits data set (python3-sklearn) with efdl.State and efdl's
DistributedSampler resumed exactly (efdl.exact_resume), so a run that is interrupted and resumed
computes the same steps on the same data as one that is not. `step` in the State is the job-wide
step count. Prints:

    RESTORED round=R rank=r world=W source=S seq=Q step=N digest=D   (S: none|memory|storage|peer)
    STEP round=R rank=r world=W step=N                               (after step N's update)
    FINAL round=R rank=r world=W step=N digest=D

D is a hash of the model's parameter bytes. Options (environment):
  WORKER_EPOCHS            epochs of the job (default 2)
  WORKER_BATCH             batch size per rank (default 16)
  WORKER_COMMIT_INTERVAL   commit every N steps (default 4)
  WORKER_STEP_TIME         seconds to sleep per step (default 0)
  WORKER_SLOW_MS           a straggler on purpose: sleep this many ms more per step, before
                           the forward pass (compute time; set on one node's agent only)
  WORKER_SLOW_FILE         ... only while this file exists (checked every step)
  WORKER_CRASH_AT          rank WORKER_CRASH_RANK (default 1) SIGKILLs itself after step N, once
  WORKER_CRASH_MARKER      ... when this file does not exist yet (it is created first)
  WORKER_SAVE              rank 0 saves the final model's state_dict here
"""

import hashlib
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import efdl.backend.torch as efdl


def env_int(name, default):
    return int(os.environ.get(name, default))


def digest(model):
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(d.target, dtype=torch.int64))


def main():
    epochs = env_int("WORKER_EPOCHS", 2)
    batch = env_int("WORKER_BATCH", 16)
    step_time = float(os.environ.get("WORKER_STEP_TIME", "0"))
    slow_s = float(os.environ.get("WORKER_SLOW_MS", "0")) / 1000.0
    slow_file = os.environ.get("WORKER_SLOW_FILE", "")
    crash_at = env_int("WORKER_CRASH_AT", -1)
    crash_rank = env_int("WORKER_CRASH_RANK", 1)
    marker = os.environ.get("WORKER_CRASH_MARKER", "")
    round_ = os.environ.get("EFDL_ROUND", "0")

    efdl.init(timeout=60)
    rank, world = efdl.get_rank(), efdl.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = efdl.State(model, optimizer, epoch=0, samples=0, step=0)
    state.set_commit_interval(env_int("WORKER_COMMIT_INTERVAL", 4))
    source = state.restored_from
    print("RESTORED round=%s rank=%d world=%d source=%s seq=%d step=%d digest=%s" % (
        round_, rank, world, source[0] if source else "none", source[1] if source else 0,
        state.step, digest(model)), flush=True)

    data = digits()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for epoch in range(state.epoch, epochs):
        state.epoch = epoch
        start = efdl.exact_resume(state.samples, batch, world)
        sampler = efdl.data.DistributedSampler(data, epoch=epoch,
                                               global_start_index=start.global_start_index)
        for x, y in DataLoader(data, batch_size=batch, sampler=sampler):
            if slow_s and (not slow_file or os.path.exists(slow_file)):
                time.sleep(slow_s)
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            state.samples += len(x) * world
            state.step += 1
            print("STEP round=%s rank=%d world=%d step=%d" % (round_, rank, world, state.step),
                  flush=True)
            if state.step == crash_at and rank == crash_rank and marker and \
                    not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if step_time:
                time.sleep(step_time)
            state.commit()
        state.epoch, state.samples = epoch + 1, 0
        state.commit()
    print("FINAL round=%s rank=%d world=%d step=%d digest=%s" % (
        round_, rank, world, state.step, digest(model)), flush=True)
    if rank == 0 and os.environ.get("WORKER_SAVE"):
        torch.save(model.state_dict(), os.environ["WORKER_SAVE"])


if __name__ == "__main__":
    main()
