"""A tiny elastic training worker for the end-to-end tests: a plain torch.distributed program.

It uses only what `efdl run` puts in the environment (env:// init with gloo), all-reduces a
tensor every step, checks the sum against WORLD_SIZE and prints one line per step:

    STEP round=R rank=r world=W step=S

Options (environment, so the command line stays the same on every node):
  WORKER_STEPS        steps of the whole job (0: run until stopped); default 0
  WORKER_STEP_TIME    seconds per step; default 0.1
  WORKER_PROGRESS     a file where rank 0 records the last finished step; every rank starts
                      from the step after it, so a new round continues instead of restarting
  WORKER_USE_CONTROL  1: poll the agent's control socket (efdl.control) and leave on "stop"
  WORKER_FAIL_RANK    this rank exits 3 when it reaches WORKER_FAIL_STEP (default 0)
  WORKER_FAIL_AFTER   K: this process raises RuntimeError after K steps of its own, in every
                      round (given to one agent only: a host whose program always fails)
  WORKER_IMPORT       a module to import at start; the START line says whether the process
                      already had it (preloaded=1: a spare forked from a zygote that imported it)
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def env_int(name, default):
    return int(os.environ.get(name, default))


def main():
    rank = env_int("RANK", 0)
    world = env_int("WORLD_SIZE", 1)
    # torchrun has no round number; its restart count plays that part in the benchmark.
    round_ = env_int("EFDL_ROUND", env_int("TORCHELASTIC_RESTART_COUNT", 0))
    steps = env_int("WORKER_STEPS", 0)
    step_time = float(os.environ.get("WORKER_STEP_TIME", "0.1"))
    progress = os.environ.get("WORKER_PROGRESS")
    fail_rank = env_int("WORKER_FAIL_RANK", -1)
    fail_step = env_int("WORKER_FAIL_STEP", 0)
    fail_after = env_int("WORKER_FAIL_AFTER", -1)

    control = None
    if os.environ.get("WORKER_USE_CONTROL") == "1":
        from efdl import control as efdl_control
        control = efdl_control.connect_from_env()

    extra = os.environ.get("WORKER_IMPORT")
    preloaded = int(bool(extra) and extra in sys.modules)
    if extra:
        __import__(extra)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    step = 0
    if progress and os.path.exists(progress):
        with open(progress) as f:
            text = f.read().strip()
            step = int(text) + 1 if text else 0
    print("START round=%d rank=%d world=%d step=%d pid=%d master_port=%s agent_store=%s "
          "preloaded=%d" % (round_, rank, world, step, os.getpid(), os.environ.get("MASTER_PORT"),
                            os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), preloaded),
          flush=True)
    own_steps = 0
    while steps == 0 or step < steps:
        if own_steps == fail_after:
            raise RuntimeError("this host is bad (WORKER_FAIL_AFTER=%d)" % fail_after)
        own_steps += 1
        if rank == fail_rank and step >= fail_step:
            print("FAILING on purpose at step %d" % step, flush=True)
            sys.exit(3)
        t = torch.ones(1)
        dist.all_reduce(t)
        if int(t.item()) != world:
            print("BAD SUM %s != %d" % (t.item(), world), flush=True)
            sys.exit(4)
        print("STEP round=%d rank=%d world=%d step=%d" % (round_, rank, world, step), flush=True)
        if rank == 0 and progress:
            tmp = progress + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, progress)
        if control is not None and control.stop_requested():
            control.notify_stopping(step, snapshot=False)
            print("STOPPING round=%d rank=%d step=%d reason=%s" %
                  (round_, rank, step, control.stop_request().reason), flush=True)
            return 0
        step += 1
        time.sleep(step_time)
    dist.barrier()
    print("DONE round=%d rank=%d step=%d" % (round_, rank, step), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
