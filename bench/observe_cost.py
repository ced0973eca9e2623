"""bench/observe_cost.py: what the node's metrics, progress reports and goodput ledger cost a
training step (issue #33).

The digits program a user would write (examples/train_ddp_state.py: efdl.State, efdl's sampler,
DDP over gloo) runs under `efdl run --nproc-per-node 2` on one node, alternately
  off  `--metrics-port off --hang-timeout 0` (no endpoint, no progress board: State.commit()'s
       progress report and the ledger are no-ops)
  on   the defaults (the metrics endpoint, the board each commit reports to, the ledger part,
       hang detection)
and each run's training throughput is measured from rank 0's step lines as they arrive (from the
first to the last, start-up excluded). Runs alternate (off, on, off, on, ...) so that a drift of
the machine's load hits both alike; the medians and their ratio are printed.

Usage: /usr/bin/python3 bench/observe_cost.py [--runs 5] [--epochs 8]. Needs EFDL_BIN or
./build/efdl. About 10 s per run on 2 cores.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = "/usr/bin/python3"
SCRIPT = os.path.join(REPO, "examples", "train_ddp_state.py")
LINE = re.compile(r"\[rank 0\] epoch \d+ step \d+ samples (\d+) ")


def efdl_bin():
    path = os.environ.get("EFDL_BIN") or os.path.join(REPO, "build", "efdl")
    if not os.access(path, os.X_OK):
        sys.exit("observe_cost: no efdl binary at %s: build it (make build) or set EFDL_BIN" % path)
    return path


def run(mode, epochs, tmp):
    """Samples per second of one run, from rank 0's step lines."""
    extra = ["--metrics-port", "off", "--hang-timeout", "0"] if mode == "off" else []
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1",
               TMPDIR=tmp)
    argv = [efdl_bin(), "run", "--nproc-per-node", "2",
            "--snapshot-dir", os.path.join(tmp, "snapshots-%s-%d" % (mode, time.time_ns())),
            *extra, "--", PYTHON, SCRIPT, "--epochs", str(epochs), "--log-interval", "5",
            "--commit-interval", "5"]
    points = []
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            m = LINE.search(line)
            if m:
                points.append((time.monotonic(), int(m.group(1))))
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    if rc != 0 or len(points) < 10:
        sys.exit("observe_cost: the %s run failed (exit %s, %d step lines)" % (mode, rc,
                                                                              len(points)))
    (t0, s0), (t1, s1) = points[1], points[-1]   # from the second line: start-up excluded
    return (s1 - s0) / (t1 - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs of each mode (default 5)")
    p.add_argument("--epochs", type=int, default=8, help="epochs of the digits program")
    args = p.parse_args()
    results = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="efdl-observe-bench-") as tmp:
        for i in range(args.runs):
            for mode in ("off", "on"):
                rate = run(mode, args.epochs, tmp)
                results[mode].append(rate)
                print("run %d %-3s %8.0f samples/s" % (i + 1, mode, rate), flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print()
    print("digits, 2 ranks, %d epochs, median of %d runs each (load: %s)" % (
        args.epochs, args.runs, open("/proc/loadavg").read().split()[0]))
    print("  baseline (--metrics-port off --hang-timeout 0): %8.0f samples/s" % off)
    print("  metrics + progress board + ledger (defaults):   %8.0f samples/s" % on)
    print("  ratio on/off: %.3f (spread of the off runs: %.0f..%.0f)" % (
        on / off, min(results["off"]), max(results["off"])))


if __name__ == "__main__":
    main()
