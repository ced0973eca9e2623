"""bench/compute_hooks.py: what measuring each rank's compute time costs a training step (issue
#32 part 3, python/efdl/_compute.py: a gradient hook per parameter tensor and two autograd
callbacks per backward pass).

One process (no DDP: the hooks' own cost, not hidden behind an all-reduce), one thread, an MLP
of L hidden 64x64 layers (2L + 2 parameter tensors) trained with SGD on a fixed batch; runs
alternate without and with the hooks (the sink adds to a Python int, as cheap as the progress
slot's two stores), so a drift of the machine's load hits both alike, and each is timed in this
thread's CPU time (time.thread_time: other processes on the cores do not count). Prints each
model's median step time without and with, the difference and the difference per parameter
tensor.

Usage: /usr/bin/python3 bench/compute_hooks.py [--runs 7] [--steps 300]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from efdl import _compute  # noqa: E402


def model(layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)],
                               torch.nn.Linear(64, 10))


def step_seconds(m, steps):
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(10):   # warm-up
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    t = time.thread_time()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return (time.thread_time() - t) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    total = [0]

    def sink(ns):
        total[0] += ns

    for layers in (1, 20, 100):
        plain, watched = [], []
        for _ in range(args.runs):
            plain.append(step_seconds(model(layers), args.steps))
            m = model(layers)
            t = _compute.watch(m, sink)
            watched.append(step_seconds(m, args.steps))
            t.detach()
        p, w = statistics.median(plain), statistics.median(watched)
        tensors = 2 * layers + 2
        print("%3d parameter tensors: %8.1f us/step without, %8.1f us/step with the hooks: "
              "%+7.1f us (%+.2f us per tensor, %+.2f%%)" % (
                  tensors, p * 1e6, w * 1e6, (w - p) * 1e6, (w - p) * 1e6 / tensors,
                  100 * (w - p) / p))


if __name__ == "__main__":
    main()
