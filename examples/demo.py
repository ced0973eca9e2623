#!/usr/bin/python3
"""EFDL in three minutes: three nodes train, one crashes, one joins, one leaves; training goes on.

Run (after building; `make demo` does both):
    PYTHONPATH=python EFDL_BIN=build/efdl /usr/bin/python3 examples/demo.py [--quick] [--out DIR]

What it does, all on loopback, every process in its own process group:
  1. starts an etcd (`efdl etcd --port 0`) and three agents (`efdl run --nnodes 2:3`, nodes
     node-a, node-b, node-c) running examples/train_elastic_run.py (small CNN on the digits data
     set, State + DistributedSampler, a commit every --commit-interval steps, one shared snapshot
     dir; written with efdl.elastic.run, so the workers of the nodes that stay keep their
     processes at every event: only newcomers start one);
  2. once training runs at world 3: SIGKILLs node-c's agent and workers without warning (a crash);
     once training runs again: starts node-d (a join); once it runs at world 3 again: SIGTERMs
     node-a's agent (a graceful leave); then lets the job finish;
  3. meanwhile runs the same script as one plain process (no agent, its own snapshot dir, batch
     size = the 3-node global batch) as the uninterrupted reference;
  4. prints a live timeline and a summary table, writes DIR/demo.png (loss over time with the
     events marked), DIR/summary.json and the agents' logs under DIR/logs/.

Pause = from the event (the signal, or starting the new agent) to the first training step of the
new round; gap = from the last step of the old round to that first step. Samples lost = the last
job-wide sample count printed before the new round minus the count the new round resumes from.

Every process it started is killed by process group when it ends, on errors and on Ctrl-C.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = "/usr/bin/python3"
SCRIPT = os.path.join(REPO, "examples", "train_elastic_run.py")

# Lines of train_elastic_run.py's rank 0 (train_ddp_state.py's too), as the agent forwards them ("[rank 0] " prefix).
RESUME_RE = re.compile(r"^(?:\[rank 0\] )?resuming at epoch (\d+), sample (\d+) of the epoch, "
                       r"(\d+) samples in all, world (\d+), round (\S+)")
STEP_RE = re.compile(r"^(?:\[rank 0\] )?epoch (\d+) step (\d+) samples (\d+) loss ([\d.naif]+) "
                     r"world (\d+) samples/s (\d+)")
EPOCH_RE = re.compile(r"^(?:\[rank 0\] )?epoch (\d+) done: test accuracy ([\d.]+)")
ROUND_RE = re.compile(r"efdl: round (\d+): node rank \d+ of")
KEPT_RE = re.compile(r"efdl: round (\d+): node rank .* continue in-process")
CLOSING_RE = re.compile(r"efdl: round (\d+) closing \((?:not )?graceful\): (.*)")
DONE_RE = re.compile(r"^(?:\[rank 0\] )?training complete: (\d+) samples, test accuracy ([\d.]+)")


class DemoError(Exception):
    """A step of the demo did not happen in time; the message says which and where to look."""


def wait_under(cond, what, predicate, timeout, where, check=None):
    """Waits (bounded) until predicate() holds and returns its value.

    predicate and check run with `cond` held; check (optional) raises DemoError when waiting is
    pointless. On timeout the DemoError names `what` and, through `where`, what to read.
    """
    deadline = time.monotonic() + timeout
    with cond:
        while True:
            value = predicate()
            if value:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoError("timed out after %d s waiting for %s%s" % (timeout, what, where))
            cond.wait(min(left, 0.5))
            if check is not None:
                check()


def efdl_binary():
    path = os.environ.get("EFDL_BIN") or shutil.which("efdl") or os.path.join(REPO, "build", "efdl")
    if not os.access(path, os.X_OK):
        raise DemoError("efdl binary not found (%s): run `make demo`, or build it and set "
                        "EFDL_BIN=build/efdl" % path)
    return path


def clean_env(shm_dir, tmp_dir):
    """The demo's environment minus anything that would make a child think it is a worker
    (EFDL_PRELOAD_MODULES and EFDL_LOG_LEVEL pass: they only shape the agents' spares and logs).

    The State's in-memory snapshot copies go to `shm_dir`, and temporary files (each agent's
    private directory, which a SIGKILLed node leaves behind) to `tmp_dir`: the demo removes both
    at the end.
    """
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("EFDL_", "TORCHELASTIC_"))
               or k in ("EFDL_PRELOAD_MODULES", "EFDL_LOG_LEVEL")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.path.join(REPO, "python") + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["EFDL_SHM_DIR"] = shm_dir
    # An agent's control socket, TMPDIR/efdl-agent-XXXXXX/control.sock, must fit a unix socket
    # address (107 bytes): under a longer TMPDIR the agents keep the caller's (and the next
    # agent's start removes what a killed one left there).
    if len(os.path.join(tmp_dir, "efdl-agent-XXXXXX", "control.sock")) <= 107:
        env["TMPDIR"] = tmp_dir
    return env


class Proc:
    """One child process leading its own process group, its output read line by line.

    Ownership: the Demo owns every Proc and kills it (kill_node) in its cleanup. The reader thread
    ends when the child's output closes; on_line is called from that thread.
    """

    def __init__(self, name, argv, env, log_path, on_line):
        self.name = name
        self._log = open(log_path, "w")
        # If the demo itself is SIGKILLed, its cleanup cannot run: have the kernel send SIGTERM to
        # each child when the demo dies (util-linux's setpriv sets PR_SET_PDEATHSIG, then execs,
        # so the pid stays the child's). Agents then leave and stop their workers; efdl etcd stops.
        if shutil.which("setpriv"):
            argv = ["setpriv", "--pdeathsig", "TERM", "--"] + list(argv)
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", start_new_session=True)
        self._on_line = on_line
        self._reader = threading.Thread(target=self._read, name="read-" + name, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self._log.write(line + "\n")
            self._log.flush()
            self._on_line(self, time.monotonic(), line)
        self._log.close()

    def alive(self):
        return self.proc.poll() is None

    def children(self):
        """Pids of the live children of this process (an agent's workers lead their own groups)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(entry))
        return pids

    def kill_node(self, sig=signal.SIGKILL):
        """`sig` to this process's group and to each child's group: a whole node at once."""
        for pgid in [self.proc.pid] + self.children():
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self):
        if self.alive():
            self.kill_node(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=5)


class Demo:
    def __init__(self, args):
        self.args = args
        self.efdl = efdl_binary()
        self.out = os.path.abspath(args.out)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix="efdl-demo-")
        # Node-local snapshot copies (tmpfs when there is one), removed with the demo.
        self.shm = tempfile.mkdtemp(prefix="efdl-demo-", dir="/dev/shm" if os.path.isdir(
            "/dev/shm") else None)
        self.job = "demo-%d-%d" % (os.getpid(), int(time.time()))
        self.procs = {}
        self.endpoint = None
        self.cond = threading.Condition()
        # Guarded by cond: what rank 0 of the elastic job printed, with arrival times.
        self.steps = []       # (t, epoch, step, total_samples, loss, world, samples_per_s)
        self.resumes = []     # (t, epoch, sample_in_epoch, total_samples, world, round)
        self.epochs = []      # (t, epoch, accuracy)
        self.complete = None  # (t, total_samples, accuracy)
        self.baseline = None  # (t, total_samples, accuracy)
        self.round_starts = {}  # round -> t the first agent started its workers
        self.kept = {}          # round -> nodes whose workers continued in-process
        self._seen = set()     # agent messages already shown once (every agent logs them)
        self.events = []
        self.t0 = time.monotonic()
        self._last_shown = 0.0

    # ---------------------------------------------------------------- output

    def say(self, text):
        # Under the (reentrant) lock: print() writes the text and the newline separately, so
        # two reader threads printing at once could glue two lines into one.
        with self.cond:
            print("%7.1fs  %s" % (time.monotonic() - self.t0, text), flush=True)

    def on_agent_line(self, p, t, line):
        shown = None
        with self.cond:
            m = STEP_RE.match(line)
            if m:
                e, s, n, loss, w, sps = m.groups()
                self.steps.append((t, int(e), int(s), int(n), float(loss), int(w), int(sps)))
                if t - self._last_shown >= self.args.show_every:
                    self._last_shown = t
                    shown = ("round %-3s world %s  epoch %s step %3s  samples %5s  loss %.3f  "
                             "%5s samples/s" % (self.resumes[-1][5] if self.resumes else "?",
                                                w, e, s, n, float(loss), sps))
            elif RESUME_RE.match(line):
                e, s, n, w, r = RESUME_RE.match(line).groups()
                self.resumes.append((t, int(e), int(s), int(n), int(w), r))
                shown = ("== round %s started on %s: world %s, resuming at epoch %s sample %s "
                         "(%s samples trained so far)" % (r, p.name, w, e, s, n))
            elif EPOCH_RE.match(line):
                e, acc = EPOCH_RE.match(line).groups()
                self.epochs.append((t, int(e), float(acc)))
                shown = "epoch %s done: test accuracy %.3f" % (e, float(acc))
            elif DONE_RE.match(line):
                n, acc = DONE_RE.match(line).groups()
                self.complete = (t, int(n), float(acc))
                shown = "training complete: %s samples, test accuracy %.3f" % (n, float(acc))
            elif not line.startswith("[rank"):
                m, c = ROUND_RE.search(line), CLOSING_RE.search(line)
                if m:
                    self.round_starts.setdefault(m.group(1), t)
                k = KEPT_RE.search(line)
                if k:
                    self.kept.setdefault(k.group(1), set()).add(p.name)
                key = ("closing", c.group(1)) if c else line
                if self.args.verbose or (key not in self._seen and re.search(
                        r"giving up|error|standby|formed|closing", line, re.IGNORECASE)):
                    self._seen.add(key)
                    shown = "   %s: %s" % (p.name, line.split(" efdl: ", 1)[-1])
            self.cond.notify_all()
        if shown:
            self.say(shown)

    def on_baseline_line(self, p, t, line):
        m = DONE_RE.match(line)
        if m:
            with self.cond:
                self.baseline = (t, int(m.group(1)), float(m.group(2)))
                self.cond.notify_all()
            self.say("reference run (1 process, no agent) done: test accuracy %.3f"
                     % float(m.group(2)))

    def on_etcd_line(self, p, t, line):
        m = re.match(r"^EFDL_ETCD_ENDPOINTS=(\S+)", line)
        if m:
            with self.cond:
                self.endpoint = m.group(1)
                self.cond.notify_all()

    def on_dashboard_line(self, p, t, line):
        m = re.search(r"efdl dashboard: job \S+ at (http://\S+)", line)
        if m:
            self.say("live page of the job: %s (open it in a browser while the demo runs)"
                     % m.group(1))

    def ledger(self):
        """The job's goodput ledger as the product keeps it (`efdl events --json`), or None."""
        try:
            out = subprocess.run([self.efdl, "events", "--etcd", self.endpoint, "--job",
                                  self.job, "--json"], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return json.loads(out.stdout) if out.returncode == 0 else None

    def wait_for(self, what, predicate, timeout):
        """Waits (bounded) until predicate() holds; predicate runs under self.cond."""
        return wait_under(self.cond, what, predicate, timeout,
                          "; the agents' logs are in %s" % os.path.join(self.out, "logs"),
                          check=self._etcd_alive)

    def _etcd_alive(self):
        for p in self.procs.values():
            if p.name == "etcd" and not p.alive():
                raise DemoError("etcd exited; see %s" % os.path.join(self.out, "logs", "etcd.log"))

    # ---------------------------------------------------------------- processes

    def start(self, name, argv, on_line):
        p = Proc(name, argv, clean_env(self.shm, self.tmp), os.path.join(self.out, "logs", name + ".log"),
                 on_line)
        self.procs[name] = p
        return p

    def train_args(self):
        a = self.args
        return [PYTHON, SCRIPT, "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
                "--lr", str(a.lr), "--commit-interval", str(a.commit_interval),
                "--log-interval", "1", "--step-delay", str(a.step_delay)]

    def start_agent(self, node):
        argv = [self.efdl, "run", "--etcd", self.endpoint, "--job", self.job, "--nnodes", "2:3",
                "--node-id", node, "--ttl", str(self.args.ttl), "--last-call", "1",
                "--stop-grace", "5", "--snapshot-dir", os.path.join(self.tmp, "snapshots"),
                # Spares with torch imported: a re-round skips python start-up and imports.
                "--prestart", "--", *self.train_args()]
        return self.start(node, argv, self.on_agent_line)

    def steps_in_round_since(self, since, world):
        """Steps printed after the first round with `world` that resumed after `since`."""
        for r in self.resumes:
            if r[0] >= since and r[4] == world:
                n = sum(1 for s in self.steps if s[0] > r[0])
                return n if n else None
        return None

    # ---------------------------------------------------------------- the story

    def event(self, kind, node, action, world_after):
        """Does `action`, records the event, waits for the new round to train a few steps."""
        with self.cond:
            t = time.monotonic()
            world_before = self.steps[-1][5] if self.steps else None
        action()
        self.say(">> %s: %s" % (kind.upper(), {
            "crash": "SIGKILL to %s's agent and workers (no warning)" % node,
            "join": "started a new node %s" % node,
            "leave": "SIGTERM to %s's agent (graceful leave)" % node}[kind]))
        self.wait_for("training to resume at world %d after the %s of %s" %
                      (world_after, kind, node),
                      lambda: (self.steps_in_round_since(t, world_after) or 0) >=
                      self.args.steps_per_phase or (self.complete and self.complete[0] > t),
                      self.args.phase_timeout)
        with self.cond:
            resume = next((r for r in self.resumes if r[0] >= t), None)
            if resume is None:
                raise DemoError(
                    "training finished before the %s of %s took effect: this machine is too slow "
                    "for the demo's schedule (see the worker start times above); run it on a less "
                    "loaded machine, or without --quick for a longer job" % (kind, node))
            # A round that resumes at the very end trains no step: it resumed when it completed.
            first = next((s for s in self.steps if s[0] > resume[0]), self.complete)
            before = [s for s in self.steps if s[0] < resume[0]]
            last = before[-1] if before else None
        ev = {"kind": kind, "node": node, "t": t - self.t0,
              "world_before": world_before, "world_after": resume[4], "round": resume[5],
              "pause_s": first[0] - t,
              "rendezvous_s": self.round_starts.get(resume[5], first[0]) - t,
              "worker_start_s": first[0] - self.round_starts.get(resume[5], t),
              "gap_s": first[0] - last[0] if last else None,
              "kept": len(self.kept.get(resume[5], ())),
              "last_samples": last[3] if last else 0, "resume_samples": resume[3]}
        lost = max(0, ev["last_samples"] - ev["resume_samples"])
        ev["samples_lost"] = lost
        ev["steps_lost"] = lost / float(self.args.batch_size * (world_before or 1))
        self.events.append(ev)
        self.say("<< training resumed in round %s at world %d, %.1f s after the %s (new round "
                 "after %.1f s + %.1f s to resume; gap between steps %.1f s; the workers of %d "
                 "node(s) kept their processes), samples lost: %d"
                 % (ev["round"], ev["world_after"], ev["pause_s"], kind, ev["rendezvous_s"],
                    ev["worker_start_s"], ev["gap_s"] or 0, ev["kept"], lost))

    def run(self):
        a = self.args
        self.say("EFDL demo: job %s, output in %s" % (self.job, self.out))
        self.start("etcd", [self.efdl, "etcd", "--port", "0",
                            "--data-dir", os.path.join(self.tmp, "etcd")], self.on_etcd_line)
        self.wait_for("`efdl etcd` to print its endpoint", lambda: self.endpoint, 30)
        self.say("etcd serving on %s" % self.endpoint)
        # The job's live page (efdl dashboard, docs/operations.md "Dashboard"), while it runs.
        self.start("dashboard", [self.efdl, "dashboard", "--etcd", self.endpoint, "--job",
                                 self.job, "--port", "0"], self.on_dashboard_line)

        ref_dir = os.path.join(self.tmp, "reference-snapshots")
        ref = [PYTHON, SCRIPT, "--epochs", str(a.epochs), "--batch-size",
               str(a.batch_size * 3), "--lr", str(a.lr), "--commit-interval",
               str(a.commit_interval), "--log-interval", "1000"]
        self.start("reference", ["env", "EFDL_SNAPSHOT_DIR=" + ref_dir,
                                 "EFDL_JOB_ID=" + self.job + "-reference", *ref],
                   self.on_baseline_line)
        self.say("reference: one plain process, batch %d (the 3-node global batch), snapshots "
                 "in its own dir" % (a.batch_size * 3))

        for node in ("node-a", "node-b", "node-c"):
            self.start_agent(node)
        self.say("started 3 agents: efdl run --nnodes 2:3 --ttl %d ... -- %s"
                 % (a.ttl, " ".join(os.path.relpath(x, REPO) if x.startswith(REPO) else x
                                    for x in self.train_args())))
        self.wait_for("the 3 nodes to train at world 3",
                      lambda: (self.steps_in_round_since(0, 3) or 0) >= a.steps_before_crash,
                      a.phase_timeout + 30)

        self.event("crash", "node-c", lambda: self.procs["node-c"].kill_node(signal.SIGKILL), 2)
        self.event("join", "node-d", lambda: self.start_agent("node-d"), 3)
        self.event("leave", "node-a",
                   lambda: self.procs["node-a"].proc.send_signal(signal.SIGTERM), 2)
        self.wait_for("node-a's agent to exit after SIGTERM",
                      lambda: not self.procs["node-a"].alive(), 60)

        self.wait_for("the job to complete", lambda: self.complete, a.phase_timeout * 3)
        codes = {}
        for node in ("node-b", "node-d"):
            self.wait_for("%s's agent to exit" % node, lambda n=node: not self.procs[n].alive(),
                          60)
            codes[node] = self.procs[node].proc.returncode
        codes["node-a"] = self.procs["node-a"].proc.returncode
        self.wait_for("the reference run", lambda: self.baseline, 120)
        return codes

    # ---------------------------------------------------------------- results

    def summary(self, codes, ledger):
        """The events and goodput as the product's ledger has them (`efdl events`), with what
        the demo saw of each event (when it acted, whose processes were kept)."""
        a = self.args
        print("\n" + "=" * 96)
        if ledger is None:
            print("(no goodput ledger: `efdl events` did not answer; see the agents' logs)")
        else:
            s = ledger["seconds"]
            print("goodput %.1f%% of %.1f s: training %.1f s, trained again %.1f s, start-up %.1f "
                  "s, restore %.1f s, rendezvous %.1f s (efdl events --etcd %s --job %s)" % (
                      100 * ledger["goodput"], ledger["wall_s"], s["training"], s["lost"],
                      s["startup"], s["restore"], s["rendezvous"], self.endpoint, self.job))
            print("%-6s %-7s %7s %6s %6s %8s %7s %8s %7s %8s %6s %6s" % (
                "event", "node", "at s", "world", "round", "pause s", "=rdzv", "+restore",
                "+1st", "samples", "steps", "nodes"))
            print("%-6s %-7s %7s %6s %6s %8s %7s %8s %7s %8s %6s %6s" % (
                "", "", "", "", "", "", "", "", "step", "lost", "lost", "kept"))
            seen_in_round = {int(e["round"]): e for e in self.events}
            for e in ledger["events"]:
                seen = seen_in_round.get(e["round"])
                node = seen["node"] if seen else "-"
                at = seen["t"] if seen else float("nan")
                kept = seen["kept"] if seen else 0
                samples = e.get("samples_lost")
                print("%-6s %-7s %7.1f %6s %6s %8.2f %7.2f %8.2f %7.2f %8s %6d %6d" % (
                    e["kind"], node, at, "%s->%s" % (e["world_before"], e["world_after"]),
                    e["round"], e["pause_s"], e["rendezvous_s"], e["restore_s"],
                    e.get("first_step_s", 0.0), "?" if samples is None else samples,
                    e["steps_lost"], kept))
            print("(from the job's goodput ledger: pause = the first sign of the event on a node "
                  "-> every rank's first step of the new round = rendezvous until the new round's "
                  "workers run + restore: the nodes kept rebuild the process group in-process "
                  "and agree on the state, a new node's worker starts and receives it + the "
                  "first step after it; nodes kept = nodes whose workers kept their processes, "
                  "as the demo saw)")
            print("(steps lost = steps trained again; samples lost = steps x the samples per step "
                  "the ranks' samplers handed out x the world before the event; commit interval %d steps: graceful changes lose 0, a crash at most "
                  "%d)" % (a.commit_interval, a.commit_interval))
        print("final test accuracy, elastic job (3 -> 2 -> 3 -> 2 nodes): %.4f (%d samples)"
              % (self.complete[2], self.complete[1]))
        print("final test accuracy, uninterrupted reference (1 process, batch %d, same seeds and "
              "epochs): %.4f (%d samples)" % (a.batch_size * 3, self.baseline[2],
                                              self.baseline[1]))
        print("agent exit codes: %s" % ", ".join("%s %s" % kv for kv in sorted(codes.items())))
        print("=" * 96)

    def plot(self, path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        with self.cond:
            steps = list(self.steps)
            resumes = list(self.resumes)
        if not steps:
            return
        x = [s[0] - self.t0 for s in steps]
        y = [s[4] for s in steps]
        fig, ax = plt.subplots(figsize=(11, 5.5))
        ax.plot(x, y, ".", ms=2.5, color="#9bb7d4", label="loss per step (rank 0)")
        # One curve per round: no line drawn across a pause, where nothing trained.
        starts = [r[0] for r in resumes] + [float("inf")]
        k = 10
        for i in range(len(starts) - 1):
            seg = [(s[0] - self.t0, s[4]) for s in steps if starts[i] <= s[0] < starts[i + 1]]
            if not seg:
                continue
            ys = [v for _, v in seg]
            avg = [sum(ys[max(0, j - k + 1):j + 1]) / len(ys[max(0, j - k + 1):j + 1])
                   for j in range(len(ys))]
            ax.plot([t for t, _ in seg], avg, "-", lw=1.8, color="#1f4e79",
                    label="loss, mean of 10 steps" if i == 0 else None)
        ax2 = ax.twinx()
        if resumes:
            ax2.step([r[0] - self.t0 for r in resumes] + [x[-1]],
                     [r[4] for r in resumes] + [resumes[-1][4]], where="post", color="grey",
                     lw=1, alpha=0.7)
        ax2.set_ylabel("world size (grey)")
        ax2.set_ylim(0, 4)
        ax2.set_yticks([1, 2, 3])
        colors = {"crash": "#c0392b", "join": "#27ae60", "leave": "#d68910"}
        top = max(y) * 1.05
        for e in self.events:
            c = colors[e["kind"]]
            ax.axvline(e["t"], color=c, lw=1.5, ls="--")
            ax.axvspan(e["t"], e["t"] + e["pause_s"], color=c, alpha=0.15)
            ax.text(e["t"], top, " %s %s\n world %s->%s\n paused %.1f s" % (
                e["kind"], e["node"], e["world_before"], e["world_after"], e["pause_s"]),
                color=c, va="top", fontsize=9)
        for r in resumes:
            ax.axvline(r[0] - self.t0, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("time since the demo started (s); dotted: a round started")
        ax.set_ylabel("training loss")
        ax.set_ylim(0, top * 1.02)
        acc = ("final test accuracy %.3f (uninterrupted reference %.3f)"
               % (self.complete[2], self.baseline[2])) if self.complete and self.baseline else ""
        ax.set_title("EFDL demo: 3 nodes, a crash, a join and a graceful leave\n" + acc)
        ax.legend(loc="lower left")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def close(self):
        for name in reversed(list(self.procs)):
            self.procs[name].close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", default=os.environ.get("EFDL_DEMO_QUICK") == "1",
                   help="a shorter run (used by tests/python/test_examples.py); "
                   "env EFDL_DEMO_QUICK=1")
    p.add_argument("--out", default=os.path.join(REPO, "demo-out"),
                   help="where demo.png, summary.json and logs/ go (default: demo-out/)")
    p.add_argument("--verbose", action="store_true", help="also show every agent log line")
    args = p.parse_args(argv)
    # Sized so that each phase shows a few seconds of training at 2 cores under some load.
    args.batch_size = 16
    args.lr = 0.1
    args.commit_interval = 5
    args.ttl = 3
    # Quick: 3 epochs, so that a loaded machine's slow worker starts still fit in the job.
    args.epochs = 3 if args.quick else 5
    args.step_delay = 0.03 if args.quick else 0.08
    args.steps_per_phase = 10 if args.quick else 30
    # Mid-epoch (30 steps an epoch at world 3), so the crash has uncommitted steps to lose.
    args.steps_before_crash = 10 if args.quick else 22
    args.show_every = 1.0 if args.quick else 1.5
    args.phase_timeout = 60
    return args


def _shown(path):
    """A path as the user can use it: relative when under the current directory, else absolute
    (a relative path to /tmp from the repository reads ../../tmp/...)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def main(argv=None):
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C stops the demo even when it was started with SIGINT ignored (from a background job
    # of a script: `cmd &` in sh ignores SIGINT, and Python then installs no handler of its own).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    demo = None
    try:
        demo = Demo(args)
        codes = demo.run()
        png = os.path.join(demo.out, "demo.png")
        demo.plot(png)
        ledger = demo.ledger()
        demo.summary(codes, ledger)
        with open(os.path.join(demo.out, "summary.json"), "w") as f:
            json.dump({"job": demo.job, "events": demo.events, "ledger": ledger,
                       "final_accuracy": demo.complete[2], "final_samples": demo.complete[1],
                       "reference_accuracy": demo.baseline[2],
                       "reference_samples": demo.baseline[1],
                       "commit_interval": args.commit_interval, "epochs": args.epochs,
                       "exit_codes": codes,
                       "pids": {n: p.proc.pid for n, p in demo.procs.items()},
                       "elapsed_s": time.monotonic() - demo.t0}, f, indent=1)
        print("plot: %s   summary: %s   logs: %s" % (
            _shown(png), _shown(os.path.join(demo.out, "summary.json")),
            _shown(os.path.join(demo.out, "logs"))))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process the demo started", file=sys.stderr)
        return 130
    except DemoError as e:
        print("demo failed: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:   # e.g. the efdl binary vanished or is being rebuilt under us
        print("demo failed: %s; rebuild with `make` and run `make demo` again" % e,
              file=sys.stderr)
        return 1
    finally:
        if demo is not None:
            demo.close()


if __name__ == "__main__":
    sys.exit(main())
