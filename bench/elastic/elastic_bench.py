"""bench/elastic: how fast training resumes after a membership change, efdl vs torchrun.

On loopback, 3 nodes of 1 gloo worker each (tests/python/workers/allreduce_worker.py, 0.1 s
steps), nnodes 2:3, default settings of each system except where noted:
  (a) SIGKILL of one whole node   -> first step of the survivors' new round (world 2)
  (b) SIGTERM of one node's agent -> first step of the new round (world 2)
  (c) start of a new node         -> first step with it included (world 3)
Systems: efdl (this build, default settings: pre-started workers for the python worker
command), efdl-spawn (the same with `efdl run --no-prestart`: every worker spawned),
efdl-prestart (explicit `--prestart`; the same as the default for this command), torchrun
with the c10d rendezvous, torchrun with the etcd-v2 rendezvous (etcd started with
--enable-v2). torchrun runs through torchrun_py311.py, which
works around torchrun 1.13's crash on Python 3.11 (see that file). In (b) the node killed is
never the c10d store's host (SIGTERM of that node ends a c10d job).

Also: the first round (start of the first node -> first step at world 3 in (a) and (b), world
2 in (c)), the efdl agent's CPU use while training is steady, and etcd requests per node per
minute (from etcd's /metrics), both over a 20 s window at world 3.

Usage: /usr/bin/python3 bench/elastic/elastic_bench.py [--systems efdl,efdl-spawn,c10d,etcd-v2]
       [--timeout 120]. Needs EFDL_BIN or ./build/efdl. Prints one table with ratios against
       efdl (defaults), or the fastest efdl variant run when efdl itself is not.
"""

import argparse
import os
import signal
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python", "workers"))
import cluster  # noqa: E402

TORCHRUN = [cluster.PYTHON, os.path.join(HERE, "torchrun_py311.py")]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def worker_env():
    return {"WORKER_STEP_TIME": "0.1"}


def start_node(c, system, name, store_port):
    env = cluster.base_env()
    env.update(worker_env())
    if system.startswith("efdl"):
        # Defaults except the snapshot dir; --ttl/--last-call etc. at their defaults.
        argv = [cluster.efdl_bin(), "run", "--etcd", c.endpoint, "--job", c.job, "--nnodes",
                "2:3", "--node-id", name, "--nproc-per-node", "1",
                "--snapshot-dir", os.path.join(c.dir, "snapshots")]
        argv += {"efdl-prestart": ["--prestart"], "efdl-spawn": ["--no-prestart"]}.get(system, [])
        argv += ["--", cluster.PYTHON, cluster.WORKER]
    else:
        endpoint = c.endpoint if system == "etcd-v2" else "127.0.0.1:%d" % store_port
        argv = TORCHRUN + ["--nnodes", "2:3", "--nproc_per_node", "1", "--max_restarts", "100",
                           "--rdzv_backend", system, "--rdzv_endpoint", endpoint,
                           "--rdzv_id", c.job, cluster.WORKER]
    agent = cluster.Agent(name, argv, env)
    c.agents.append(agent)
    return agent


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def etcd_requests(endpoint):
    total = 0.0
    with urllib.request.urlopen("http://%s/metrics" % endpoint, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("grpc_server_msg_received_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


ROUND_LINE = ": node rank "
# Steady training before each event: long enough for efdl's pre-started spares (started 5 s
# after a round begins, then `import torch`: ~6 s at load average 10) to be ready, as they are
# in a long-running job; with less, (c)'s newcomer imports while the others' spares still do.
SETTLE_S = 15.0


def scenario(system, kind, timeout, steady=None, breakdown=None, first=None):
    c = cluster.Cluster(job="bench-%s-%s-%d" % (system.replace("-", ""), kind, os.getpid()))
    try:
        c.start_etcd(enable_v2=(system == "etcd-v2"))
        store_port = cluster.free_port()
        start = time.monotonic()
        nodes = [start_node(c, system, "n%d" % i, store_port) for i in range(2)]
        if system == "c10d":
            time.sleep(1.0)  # the first node must host the store before others connect
        if kind != "join":
            nodes.append(start_node(c, system, "n2", store_port))
            formed = c.wait_for_world(3, timeout=timeout, by_round=False)
            if first is not None:
                first.setdefault(system, []).append(formed - start)
            if steady is not None and system.startswith("efdl"):
                time.sleep(2)
                cpu0 = sum(cpu_seconds(n.proc.pid) for n in nodes)
                req0, t0 = etcd_requests(c.endpoint), time.monotonic()
                time.sleep(20)
                dt = time.monotonic() - t0
                steady[system] = {}
                steady[system]["cpu_percent_per_agent"] = 100 * (
                    sum(cpu_seconds(n.proc.pid) for n in nodes) - cpu0) / dt / len(nodes)
                steady[system]["etcd_requests_per_node_min"] = (
                    (etcd_requests(c.endpoint) - req0) / len(nodes) / (dt / 60))
            time.sleep(SETTLE_S)
            victim = nodes[2]
            t0 = time.monotonic()
            if kind == "kill":
                victim.signal_group(signal.SIGKILL)
            else:
                victim.proc.send_signal(signal.SIGTERM)
            done = c.wait_for_world(2, since=t0, agents=nodes[:2], timeout=timeout,
                                    by_round=False)
        else:
            formed = c.wait_for_world(2, timeout=timeout, by_round=False)
            if first is not None:
                first.setdefault(system, []).append(formed - start)
            time.sleep(SETTLE_S)
            t0 = time.monotonic()
            nodes.append(start_node(c, system, "n2", store_port))
            done = c.wait_for_world(3, since=t0, timeout=timeout, by_round=False)
        if system.startswith("efdl") and breakdown is not None:
            # When the agents had the new round's workers spawning: the rest is worker start-up
            # (python, import torch, init_process_group) and the first step.
            members = nodes[:2] if kind != "join" else nodes
            ready = []
            for n in members:
                with n._lock:
                    times = [t for t, text in n.lines if t >= t0 and ROUND_LINE in text]
                if times:
                    ready.append(min(times))
            if len(ready) == len(members):
                breakdown[(system, kind)] = max(ready) - t0
        return done - t0
    except AssertionError as e:
        print("  %s/%s: no result (%s)" % (system, kind, str(e).splitlines()[0]), flush=True)
        return None
    finally:
        c.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", default="efdl,efdl-spawn,c10d,etcd-v2")
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    # SIGTERM (timeout(1), a CI limit) unwinds like Ctrl-C, so `finally: c.close()` stops the
    # etcd and agents this bench started instead of leaving them running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if cluster.efdl_bin() is None:
        sys.exit("elastic_bench: efdl binary not found; build first or set EFDL_BIN")
    systems = args.systems.split(",")
    kinds = [("kill", "(a) SIGKILL node -> step"), ("term", "(b) SIGTERM node -> step"),
             ("join", "(c) new node -> step")]
    results, steady, breakdown, first = {}, {}, {}, {}
    for system in systems:
        for kind, _ in kinds:
            t = scenario(system, kind, args.timeout, steady if kind == "kill" else None,
                         breakdown, first)
            results[(system, kind)] = t
            print("  %-8s %-5s %s" % (system, kind, "%.2f s" % t if t is not None else "-"),
                  flush=True)

    def fmt(t):
        return "%7.2f s" % t if t is not None else "      - "

    header = "%-28s" % "scenario" + "".join("%12s" % s for s in systems)
    header += "".join("%14s" % ("ratio " + s) for s in systems if not s.startswith("efdl"))
    print("\n" + header)
    for kind, label in kinds:
        row = "%-28s" % label + "".join("%12s" % fmt(results[(s, kind)]) for s in systems)
        # Ratios against efdl at its defaults, else the fastest efdl variant run.
        ours = [results.get((s, kind)) for s in systems if s.startswith("efdl")]
        ours = [t for t in ours if t is not None]
        base = results.get(("efdl", kind)) if "efdl" in systems else None
        base = base or (min(ours) if ours else None)
        for s in systems:
            if s.startswith("efdl"):
                continue
            other = results[(s, kind)]
            row += "%14s" % ("%.1fx" % (other / base) if base and other else "-")
        print(row)
    if first:
        print("\nfirst round (start of the first node -> first step; (a) (b) at world 3, (c) at "
              "world 2): " + ", ".join("%s %s" % (s, " / ".join("%.2f s" % t for t in v))
                                       for s, v in first.items()))
    if breakdown:
        print("\nevent -> new round's workers started on every member (agent + rendezvous "
              "part): " + ", ".join("%s/%s %.2f s" % (s, k, v) for (s, k), v in breakdown.items()))
    for s, v in steady.items():
        print("\n%s steady state at world 3 (20 s): agent CPU %.2f%% of a core per agent; "
              "%.0f etcd requests per node per minute" % (s, v["cpu_percent_per_agent"],
                                                        v["etcd_requests_per_node_min"]))


if __name__ == "__main__":
    main()
