#!/usr/bin/env python3
"""`make soak`: the fault suite over and over with fresh random seeds for --duration seconds,
plus the soak-only case (several random kills and freezes in one long job).

    /usr/bin/python3 tests/faults/soak.py --duration 1800 [-k EXPR]

Prints one line per run (seed, result, seconds, load average, pytest's summary), then the
faults that run injected (the cases' `soak:`/`killed`/`restored` lines), and a final summary;
exits 1 if any run failed. A failed run's output is kept in --log-dir so it can be replayed with
FAULT_SEED=<seed>.
"""

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# What the cases print about the faults they injected and what was restored (pytest -s).
FAULT_LINE = re.compile(r"^\.?(soak: .*|killed .*|restored .*|persisted .*)$")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=1800, help="seconds to keep going")
    p.add_argument("-k", default="", help="pytest -k expression selecting the cases")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "efdl-soak-logs"),
                   help="where failed runs' output goes")
    p.add_argument("--case-timeout", type=float, default=600, help="seconds per pytest run")
    args = p.parse_args()
    if args.duration <= 0:
        p.error("--duration must be positive (seconds), e.g. --duration 600")

    os.makedirs(args.log_dir, exist_ok=True)
    rng = random.Random()
    deadline = time.monotonic() + args.duration
    runs, failed = 0, []
    while time.monotonic() < deadline:
        seed = rng.randrange(1, 10 ** 6)
        env = dict(os.environ, FAULT_SEED=str(seed), FAULT_SOAK="1",
                   FAULT_SOAK_FAULTS=str(rng.randrange(2, 6)))
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rfE", "-x", "-p", "no:cacheprovider",
               HERE]
        if args.k:
            cmd += ["-k", args.k]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.case_timeout)
            ok, out = proc.returncode == 0, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            ok, out = False, "timed out after %ss\n%s" % (args.case_timeout, e.stdout or "")
        runs += 1
        took = time.monotonic() - started
        summary = (out.strip().splitlines() or ["(no output)"])[-1]
        print("run %d seed %d: %s in %.0f s (load %.1f): %s" % (
            runs, seed, "ok" if ok else "FAILED", took, os.getloadavg()[0], summary), flush=True)
        for line in out.splitlines():
            m = FAULT_LINE.match(line.strip())
            if m:
                print("    " + m.group(1), flush=True)
        if not ok:
            path = os.path.join(args.log_dir, "seed-%d.log" % seed)
            with open(path, "w") as f:
                f.write(out if isinstance(out, str) else out.decode(errors="replace"))
            failed.append((seed, path))
    print("soak: %d runs, %d failed%s" % (runs, len(failed), "".join(
        "\n  FAULT_SEED=%d: %s" % f for f in failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
