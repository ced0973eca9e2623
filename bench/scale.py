#!/usr/bin/python3
"""bench/scale: how EFDL's rendezvous grows with the number of nodes (issues 4 and 37).

Runs `efdl sim --json` (N nodes' real Rendezvous objects in one process against one local etcd,
driven by a small pool of threads; only workers are simulated) for each N, prints every
scenario's time, its ratio to a raw-etcd baseline measured in the same run, requests/bytes/watch
events per round, agent CPU per node, etcd CPU, and the least-squares slope of each against N
(log-log exponent: 1.0 means linear). For N up to --compare-max the first simulator (one thread
per node) runs too, in the same invocation; its times and the ratio to the pool's follow.

  bench/scale.py [--efdl build/efdl] [--nodes 100,500,1000] [--etcd HOST:PORT] [--json OUT]
                 [--compare-max 2000] [--ttl 10] [--sim-args "..."]
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
    ap.add_argument("--compare-max", default="2000",
                    help="also run the thread-per-node simulator up to this N (0: never)")
    ap.add_argument("--ttl", default="10", help="lease TTL of the simulated nodes, seconds")
    ap.add_argument("--sim-args", default="", help="more efdl sim arguments, space separated")
    args = ap.parse_args()
    if not os.access(args.efdl, os.X_OK):
        sys.exit(f"bench/scale: error: no efdl binary at {args.efdl}: build first (make build) or pass --efdl")
    reports, old_reports = [], []
    for n in args.nodes.split(","):
        cmd = [args.efdl, "sim", "--nodes", n, "--json", "--compare-max", args.compare_max,
               "--ttl", args.ttl] + args.sim_args.split()
        if args.etcd:
            cmd += ["--etcd", args.etcd]
        env = dict(os.environ, EFDL_LOG_LEVEL="error")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode != 0 and not out.stdout.strip():
            sys.exit(f"bench/scale: error: {' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
        for line in out.stdout.strip().splitlines():
            r = json.loads(line)
            (reports if r.get("driver_threads", 1) != 0 else old_reports).append(r)
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
        for metric in ("seconds", "requests", "bytes", "watch_events", "agent_cpu_ms_per_node",
                       "etcd_cpu_ms"):
            ys = [r["scenarios"][i].get(metric, float("nan")) if i < len(r["scenarios"]) else float("nan")
                  for r in reports]
            if any(isinstance(y, float) and math.isnan(y) for y in ys):
                continue
            _, b, k = fit(xs, ys) if len(xs) > 1 else (0, 0, 0)
            vals = " ".join(f"{y:>12.3f}" if isinstance(y, float) else f"{y:>12}" for y in ys)
            print(f"{nm:<28} {metric:<16} {vals} {b:>12.4f} {k:>9.2f}")
    print()
    for r in reports:
        print(f"N={r['nodes']}: steady agent CPU {r['steady_cpu_percent_per_node']:.4f} % of a core per node, "
              f"{r['steady_requests_per_node_per_min']} unary requests per node per minute, "
              f"etcd resident {r.get('etcd_rss_mb', -1):.0f} MiB "
              f"(GOGC {r.get('etcd_gogc') or 'of the given etcd'})")
        lost = ", ".join(f"{s['name']} {s.get('leases_lost', '?')}" for s in r["scenarios"])
        print(f"N={r['nodes']}: leases of live nodes lost (starvation, not kills): {lost}")
    if old_reports:
        print()
        print("The first simulator (one driver thread per node), same runs: seconds (x its time / the pool's)")
        pool_by_n = {r["nodes"]: r for r in reports}
        for r in old_reports:
            cells = []
            for i, s in enumerate(r["scenarios"]):
                p = pool_by_n.get(r["nodes"], {}).get("scenarios", [])
                ratio = s["seconds"] / p[i]["seconds"] if i < len(p) and p[i]["seconds"] else float("nan")
                mark = "" if s["ok"] else " FAILED"
                cells.append(f"{s['seconds']:8.3f}s (x{ratio:5.1f}){mark:>7}")
            print(f"{r['nodes']:>6} {r['baseline_seconds']:>10.3f} " + " ".join(f"{c:>26}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports + old_reports, f, indent=1)


if __name__ == "__main__":
    main()
