"""bench/elastic/back_to_back.py: real programs, three membership changes 5 s apart, efdl vs torchrun.

One job of 3 nodes x 1 gloo worker on loopback (nnodes 2:3, default settings of each system),
on a program a user would write, with no wait beyond the events' own spacing:
  training at world 3 -> SIGKILL of node n2 (agent and workers)   [kill]
  5 s later           -> a new node n3 starts                     [join]
  5 s later           -> SIGTERM to node n1's agent               [leave]
(n1, not n0: SIGTERM of torchrun's c10d store host ends a torchrun job.)

Programs:
  demo   examples/train_ddp_state.py (efdl.State, efdl's sampler; the restart path)
  elastic examples/train_elastic_run.py (the same program written with efdl.elastic.run: under
         efdl the workers of the nodes that stay keep their processes; `make demo`'s program)
  plain  bench/elastic/plain_ddp.py (init_process_group("gloo"), torch's DistributedSampler,
         torch.save every 20 steps; no efdl import)
Systems: efdl (`efdl run` defaults: spares forked from a zygote that learns the program's
imports, the agent store), efdl-nolearn (the same with `--no-learn-imports`, not in the default
list), efdl-venv (the defaults, but the worker command's interpreter is a virtual environment's
that cannot import efdl: made with --system-site-packages, no PYTHONPATH to the package; the
plain program only, the others import efdl; not in the default list; issue #39),
efdl-spawn (`--no-prestart`), c10d (torchrun 1.13 with the c10d rendezvous, through
torchrun_py311.py). torchrun runs the demo
program too: State then works standalone on each rank, as under any launcher.

Per event, from rank 0's step lines (whichever node holds rank 0; the time a line arrived):
  resume   event -> first step at the world size the event leads to, if that comes before the
           next event (else '>' the time to the next event: not resumed in time)
  stall    the longest pause between two steps that began from the event to the next event
           (the last step before the event included; it may end after the next event)
  lost     samples trained before that pause and trained again after it (the program's own
           sample counter goes back), 0 when nothing is repeated

Usage: /usr/bin/python3 bench/elastic/back_to_back.py [--programs demo,elastic,plain]
       [--systems efdl,efdl-nolearn,efdl-venv,efdl-spawn,c10d] [--gap 5] [--log-dir DIR]. Needs EFDL_BIN or ./build/efdl. About 40-80 s
per program and system. Prints one table per program with ratios against torchrun, and the
training time lost over the whole sequence (pauses longer than 3 median steps, from the first
event to 1 s after training resumed at world 2 after the last).
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python", "workers"))
import cluster  # noqa: E402

REPO = cluster.REPO
TORCHRUN = [cluster.PYTHON, os.path.join(HERE, "torchrun_py311.py")]
BATCH = 16
# rank 0's line per step: (world, samples)
DEMO_LINE = re.compile(r"^(?:\[rank \d+\] )?epoch \d+ step \d+ samples (\d+) loss \S+ world (\d+)")
LINE_RES = {
    "demo": DEMO_LINE,
    "elastic": DEMO_LINE,
    "plain": re.compile(r"^(?:\[rank \d+\] )?STEP world=(\d+) step=\d+ samples=(\d+)"),
}
EVENTS = (("kill", 2), ("join", 3), ("leave", 2))   # event, the world size it leads to


def program_argv(program, c):
    if program in ("demo", "elastic"):
        script = "train_ddp_state.py" if program == "demo" else "train_elastic_run.py"
        return [os.path.join(REPO, "examples", script), "--epochs", "200",
                "--batch-size", str(BATCH), "--commit-interval", "5", "--log-interval", "1",
                "--step-delay", "0.03"]
    return [os.path.join(HERE, "plain_ddp.py"), "--epochs", "200", "--batch-size", str(BATCH),
            "--step-delay", "0.03", "--ckpt-dir", os.path.join(c.dir, "ckpt")]


def venv_python(c):
    """efdl-venv: the interpreter of a virtual environment of cluster.PYTHON (torch from its
    site-packages) in the cluster's directory, which must not import efdl by itself."""
    venv = os.path.join(c.dir, "venv")
    python = os.path.join(venv, "bin", "python3")
    if not os.path.exists(python):
        subprocess.run([cluster.PYTHON, "-m", "venv", "--system-site-packages", "--without-pip",
                        venv], check=True, timeout=120)
        env = {k: v for k, v in cluster.base_env().items() if k != "PYTHONPATH"}
        if subprocess.run([python, "-c", "import efdl"], env=env, cwd="/",
                          capture_output=True, timeout=60).returncode == 0:
            raise AssertionError("efdl is installed for %s (make install): a venv of it "
                                 "imports efdl, which is not the case efdl-venv measures"
                                 % cluster.PYTHON)
    return python


def start_node(c, system, program, name, store_port):
    env = cluster.base_env()
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    python = cluster.PYTHON
    if system == "efdl-venv":
        if program != "plain":
            raise AssertionError("efdl-venv runs the plain program only (the others import "
                                 "efdl)")
        python = venv_python(c)
        del env["PYTHONPATH"]
    if os.environ.get("EFDL_LOG_LEVEL"):   # base_env() leaves out every EFDL_ variable
        env["EFDL_LOG_LEVEL"] = os.environ["EFDL_LOG_LEVEL"]
    # A SIGKILLed agent cannot remove its socket directory: keep it inside the cluster's.
    env["TMPDIR"] = c.dir
    # The demo program's State keeps its snapshots here when no agent does (torchrun).
    env["EFDL_SNAPSHOT_DIR"] = os.path.join(c.dir, "snapshots")
    env["EFDL_JOB_ID"] = c.job if system == "c10d" else ""
    if not env["EFDL_JOB_ID"]:
        del env["EFDL_JOB_ID"]
    prog = program_argv(program, c)
    if system.startswith("efdl"):
        argv = [cluster.efdl_bin(), "run", "--etcd", c.endpoint, "--job", c.job, "--nnodes",
                "2:3", "--node-id", name, "--nproc-per-node", "1",
                "--snapshot-dir", os.path.join(c.dir, "snapshots")]
        argv += {"efdl-spawn": ["--no-prestart"],
                 "efdl-nolearn": ["--no-learn-imports"]}.get(system, [])
        argv += ["--", python] + prog
    else:
        argv = TORCHRUN + ["--nnodes", "2:3", "--nproc_per_node", "1", "--max_restarts", "100",
                           "--rdzv_backend", "c10d", "--rdzv_endpoint",
                           "127.0.0.1:%d" % store_port, "--rdzv_id", c.job] + prog
    agent = cluster.Agent(name, argv, env)
    c.agents.append(agent)
    return agent


def steps(c, program):
    """(monotonic time, world, samples) of rank 0's step lines, in time order."""
    out = []
    for a in c.agents:
        with a._lock:
            lines = list(a.lines)
        for t, text in lines:
            m = LINE_RES[program].match(text)
            if m:
                if program in ("demo", "elastic"):
                    samples, world = int(m.group(1)), int(m.group(2))
                else:
                    world, samples = int(m.group(1)), int(m.group(2))
                out.append((t, world, samples))
    return sorted(out)


def measure(points, at, until, world):
    """resume, stall, lost for an event at `at` whose window ends at `until` (the next event)."""
    before = [p for p in points if p[0] < at]
    after = [p for p in points if at <= p[0] < until]
    resume = next((p[0] - at for p in after if p[1] == world), None)
    # The longest pause that began in the window (the last step before it included), even if
    # it ended after the next event: a join's round change begins once the newcomer is ready.
    gaps = [(b[0] - a[0], i) for i, (a, b) in enumerate(zip(points, points[1:]))
            if before and a[0] >= before[-1][0] and a[0] < until]
    if not gaps:
        return resume, None, None
    stall, i = max(gaps)
    # Across that pause: what was trained before it and is trained again after it (the first
    # step after it already counts its own batch).
    done_before = max(p[2] for p in points[:i + 1])
    first = points[i + 1]
    lost = max(done_before - (first[2] - BATCH * first[1]), 0)
    return resume, stall, lost


def save_logs(c, log_dir, system, program, t0):
    """Each node's output (agent and workers) as LOG_DIR/PROGRAM-SYSTEM-NODE.log, every line
    prefixed with its arrival time in seconds since the first event (negative before it)."""
    os.makedirs(log_dir, exist_ok=True)
    for a in c.agents:
        with a._lock:
            lines = list(a.lines)
        path = os.path.join(log_dir, "%s-%s-%s.log" % (program, system, a.name))
        with open(path, "w") as f:
            for t, text in lines:
                f.write("%+9.3f %s\n" % (t - t0, text))


def scenario(system, program, gap, timeout, log_dir=None):
    c = cluster.Cluster(job="b2b-%s-%s-%d" % (system.replace("-", ""), program, os.getpid()))
    times = []
    try:
        c.start_etcd()
        os.makedirs(os.path.join(c.dir, "ckpt"), exist_ok=True)
        store_port = cluster.free_port()
        nodes = [start_node(c, system, program, "n0", store_port)]
        if system == "c10d":
            time.sleep(1.0)  # the first node hosts the store before the others connect
        nodes += [start_node(c, system, program, "n%d" % i, store_port) for i in (1, 2)]
        cluster.wait_for(lambda: any(p[1] == 3 for p in steps(c, program)), timeout,
                         "%s/%s: training at world 3" % (system, program))
        time.sleep(1.0)   # a few steps at world 3
        times.append(time.monotonic())
        nodes[2].signal_group(signal.SIGKILL)
        time.sleep(gap)
        times.append(time.monotonic())
        nodes.append(start_node(c, system, program, "n3", store_port))
        time.sleep(gap)
        times.append(time.monotonic())
        nodes[1].proc.send_signal(signal.SIGTERM)
        # After the last event: until training resumed at world 2, or `timeout`.
        last = times[-1]
        try:
            cluster.wait_for(lambda: any(p[0] > last and p[1] == 2 for p in steps(c, program)),
                             timeout, "the step after the leave")
            time.sleep(1.0)
        except AssertionError:
            pass
        end = time.monotonic()
        points = steps(c, program)
        results = {}
        # Training time lost over the whole sequence: pauses beyond 3 median steps.
        run = [p[0] for p in points if p[0] >= times[0] - 2]
        gaps = sorted(b - a for a, b in zip(run, run[1:]))
        median = gaps[len(gaps) // 2] if gaps else 0
        results["total"] = sum(g for g in gaps if g > 3 * median)
        for i, (kind, world) in enumerate(EVENTS):
            until = times[i + 1] if i + 1 < len(times) else end
            resume, stall, lost = measure(points, times[i], until, world)
            results[kind] = {"resume": resume, "window": until - times[i], "stall": stall,
                             "lost": lost}
        return results
    except AssertionError as e:
        print("  %s/%s: no result (%s)" % (system, program, str(e).splitlines()[0]), flush=True)
        return None
    finally:
        if log_dir:
            save_logs(c, log_dir, system, program, times[0] if times else time.monotonic())
        c.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", default="demo,elastic,plain")
    parser.add_argument("--systems", default="efdl,efdl-spawn,c10d")
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between the events")
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--log-dir", help="keep each node's output there (times since the "
                        "first event); EFDL_LOG_LEVEL=debug adds the agents' phases")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if cluster.efdl_bin() is None:
        sys.exit("back_to_back: efdl binary not found; build first or set EFDL_BIN")
    systems = args.systems.split(",")
    all_results = {}
    for program in args.programs.split(","):
        for system in systems:
            print("  running %s / %s ..." % (program, system), flush=True)
            all_results[(program, system)] = scenario(system, program, args.gap, args.timeout,
                                                       args.log_dir)

    def fmt_resume(r):
        if r is None:
            return "-"
        return "%.2f s" % r["resume"] if r["resume"] is not None else ">%.1f s" % r["window"]

    def fmt(value, unit=" s"):
        return "-" if value is None else ("%.2f%s" % (value, unit) if unit else "%d" % value)

    for program in args.programs.split(","):
        print("\nprogram %s, events %.0f s apart (resume / stall / samples lost)" % (
            program, args.gap))
        ratios = [s for s in systems if s != "c10d" and "c10d" in systems]
        width = max([16] + [len("c10d / " + s) + 2 for s in ratios])
        print("%-6s" % "event" + "".join("%34s" % s for s in systems) + "".join(
            "%*s" % (width, "c10d / " + s) for s in ratios))
        for kind, _ in EVENTS:
            row = "%-6s" % kind
            for s in systems:
                r = (all_results.get((program, s)) or {}).get(kind)
                row += "%34s" % ("-" if r is None else "%s / %s / %s" % (
                    fmt_resume(r), fmt(r["stall"]), fmt(r["lost"], None)))
            for s in systems:
                if s == "c10d" or "c10d" not in systems:
                    continue
                ours = (all_results.get((program, s)) or {}).get(kind)
                theirs = (all_results.get((program, "c10d")) or {}).get(kind)
                if ours and theirs and ours["stall"] and theirs["stall"]:
                    row += "%*s" % (width, "%.1fx stall" % (theirs["stall"] / ours["stall"]))
                else:
                    row += "%*s" % (width, "-")
            print(row)
        print("%-6s" % "paused" + "".join(
            "%34s" % ("-" if not all_results.get((program, s)) else
                      "%.2f s in all" % all_results[(program, s)]["total"]) for s in systems))


if __name__ == "__main__":
    main()
