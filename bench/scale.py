#!/usr/bin/python3
"""bench/scale: how EFDL's rendezvous grows with the number of nodes (issue 4).

Runs `efdl sim --json` (N nodes' real Rendezvous objects in one process against one local etcd;
only workers are simulated) for each N, prints every scenario's time, its ratio to a raw-etcd
baseline measured in the same run, requests/bytes/watch events per round, agent CPU per node,
and the least-squares slope of each against N (log-log exponent: 1.0 means linear).

  bench/scale.py [--efdl build/efdl] [--nodes 100,500,1000] [--etcd HOST:PORT] [--json OUT]
"""
import argparse
import json
import math
import os
import subprocess
import sys


def fit(xs, ys):
    """Least squares y = a + b*x, and the log-log exponent k of y ~ x^k."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mlx, mly = sum(lx) / n, sum(ly) / n
    slxx = sum((x - mlx) ** 2 for x in lx)
    k = sum((x - mlx) * (y - mly) for x, y in zip(lx, ly)) / slxx if slxx else 0.0
    return a, b, k


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--efdl", default=os.environ.get("EFDL_BIN", os.path.join(here, "..", "build", "efdl")))
    ap.add_argument("--nodes", default="100,500,1000")
    ap.add_argument("--etcd", default="")
    ap.add_argument("--json", default="", help="also write the raw reports here")
    args = ap.parse_args()
    if not os.access(args.efdl, os.X_OK):
        sys.exit(f"bench/scale: error: no efdl binary at {args.efdl}: build first (make build) or pass --efdl")
    reports = []
    for n in args.nodes.split(","):
        cmd = [args.efdl, "sim", "--nodes", n, "--json"]
        if args.etcd:
            cmd += ["--etcd", args.etcd]
        env = dict(os.environ, EFDL_LOG_LEVEL="error")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode != 0 and not out.stdout.strip():
            sys.exit(f"bench/scale: error: {' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"N={n}: done", file=sys.stderr, flush=True)

    names = [s["name"] for s in reports[0]["scenarios"]]
    print("EFDL rendezvous scale (efdl sim: one process, one shared etcd client, one local etcd)")
    print(f"{'N':>6} {'baseline s':>10} " + " ".join(f"{nm:>26}" for nm in names))
    for r in reports:
        cells = []
        for s in r["scenarios"]:
            ratio = s["seconds"] / r["baseline_seconds"] if r["baseline_seconds"] else float("nan")
            mark = "" if s["ok"] else " FAILED"
            cells.append(f"{s['seconds']:8.3f}s (x{ratio:5.1f}){mark:>7}")
        print(f"{r['nodes']:>6} {r['baseline_seconds']:>10.3f} " + " ".join(f"{c:>26}" for c in cells))
    print()
    print(f"{'scenario':<28} {'metric':<16} " + " ".join(f"{'N=' + str(r['nodes']):>12}" for r in reports)
          + f" {'per node':>12} {'exponent':>9}")
    xs = [r["nodes"] for r in reports]
    for i, nm in enumerate(names):
        for metric in ("seconds", "requests", "bytes", "watch_events", "agent_cpu_ms_per_node"):
            ys = [r["scenarios"][i][metric] if i < len(r["scenarios"]) else float("nan") for r in reports]
            if any(isinstance(y, float) and math.isnan(y) for y in ys):
                continue
            _, b, k = fit(xs, ys) if len(xs) > 1 else (0, 0, 0)
            vals = " ".join(f"{y:>12.3f}" if isinstance(y, float) else f"{y:>12}" for y in ys)
            print(f"{nm:<28} {metric:<16} {vals} {b:>12.4f} {k:>9.2f}")
    print()
    for r in reports:
        print(f"N={r['nodes']}: steady agent CPU {r['steady_cpu_percent_per_node']:.4f} % of a core per node, "
              f"{r['steady_requests_per_node_per_min']} unary requests per node per minute")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
