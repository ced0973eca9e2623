"""A State worker for the suspend tests: a large state committed every step, so a background
persist is nearly always in flight when a suspend arrives.

Prints "RESUMED step=S value=V" at start (V: the restored tensor's value, step + 1 when the
snapshot of step S is the one restored) and "STEP round=R rank=K world=W step=S" before each
commit. SUSPEND_WORKER_MB (64) sizes the state, SUSPEND_WORKER_STEPS (100000) ends the run,
SUSPEND_WORKER_INTERVAL (1) is the commit interval, SUSPEND_WORKER_SLEEP_MS (0) paces the steps.
"""

import os
import sys
import time

import torch

import efdl.backend.torch as efdl

efdl.init()
mb = int(os.environ.get("SUSPEND_WORKER_MB", "64"))
steps = int(os.environ.get("SUSPEND_WORKER_STEPS", "100000"))
state = efdl.State(step=-1, blob=torch.zeros(mb * 1024 * 1024 // 4))
state.set_commit_interval(int(os.environ.get("SUSPEND_WORKER_INTERVAL", "1")))
pause = float(os.environ.get("SUSPEND_WORKER_SLEEP_MS", "0")) / 1000
print("RESUMED step=%d value=%d" % (state.step, int(state.blob[0].item())), flush=True)
for step in range(state.step + 1, steps):
    state.blob.add_(1)
    state.step = step
    print("STEP round=%s rank=%d world=%d step=%d" % (os.environ.get("EFDL_ROUND", "0"),
                                                      efdl.get_rank(), efdl.get_world_size(),
                                                      step), flush=True)
    state.commit()
    if pause:
        time.sleep(pause)
sys.exit(0)
