"""A job of several EFDL nodes on this one machine, for the one-command examples.

Used by fragmented.py: starts a private `efdl etcd` on a free loopback
port and `efdl run` agents ("nodes"), prints their output live (prefixed with the node's name),
lets the example wait for a line, kill a node without warning, and stops every process it
started (by process group, never by name) on exit, Ctrl-C or SIGTERM. Each process is a
demo.Proc: its own session, PR_SET_PDEATHSIG through setpriv when available.
"""

import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import REPO, DemoError, Proc, clean_env, efdl_binary, wait_under  # noqa: E402

PYTHON = "/usr/bin/python3"


class LocalJob:
    """Owns the etcd and every node it starts; close() stops them all (idempotent)."""

    def __init__(self, name):
        self.efdl = efdl_binary()
        self.job = "%s-%d-%d" % (name, os.getpid(), int(time.time()))
        self.tmp = tempfile.mkdtemp(prefix="efdl-%s-" % name)
        self.shm = tempfile.mkdtemp(prefix="efdl-%s-" % name, dir="/dev/shm" if os.path.isdir(
            "/dev/shm") else None)
        self.snapshots = os.path.join(self.tmp, "snapshots")
        self.env = clean_env(self.shm, self.tmp)
        self.procs = {}
        self.endpoint = None
        self.cond = threading.Condition()
        self.lines = []          # (node name, text), guarded by cond
        self.t0 = time.monotonic()

    def say(self, text):
        # Under the (reentrant) lock: print() writes the text and the newline separately, so
        # two reader threads printing at once could glue two nodes' lines into one.
        with self.cond:
            print("%6.1fs  %s" % (time.monotonic() - self.t0, text), flush=True)

    def _on_line(self, proc, t, line):
        with self.cond:
            self.lines.append((proc.name, line))
            if proc.name == "etcd":
                m = re.match(r"^EFDL_ETCD_ENDPOINTS=(\S+)", line)
                if m:
                    self.endpoint = m.group(1)
            self.cond.notify_all()
            if proc.name != "etcd":
                print("%6.1fs  %-7s %s" % (t - self.t0, proc.name, line), flush=True)

    def start_etcd(self):
        self.procs["etcd"] = Proc("etcd", [self.efdl, "etcd", "--port", "0", "--data-dir",
                                           os.path.join(self.tmp, "etcd")],
                                  self.env, os.path.join(self.tmp, "etcd.log"), self._on_line)
        self.wait_for("`efdl etcd` to print its endpoint", lambda: self.endpoint, 30)
        self.say("etcd serving on %s (job %s)" % (self.endpoint, self.job))

    def start_node(self, name, run_args, command):
        """`efdl run --etcd EP --job JOB --node-id NAME <run_args> -- <command>`."""
        argv = [self.efdl, "run", "--etcd", self.endpoint, "--job", self.job, "--node-id", name,
                "--snapshot-dir", self.snapshots] + list(run_args) + ["--"] + list(command)
        self.say("start %s: efdl run ... %s -- %s" % (name, " ".join(run_args), " ".join(
            os.path.relpath(x, REPO) if x.startswith(REPO + "/") else x for x in command)))
        self.procs[name] = Proc(name, argv, self.env, os.path.join(self.tmp, name + ".log"),
                                self._on_line)
        return self.procs[name]

    def wait_for(self, what, predicate, timeout):
        """Waits (bounded) until predicate() holds (it runs under self.cond); returns its value."""
        return wait_under(self.cond, what, predicate, timeout, " (the nodes' output is above)")

    def count(self, pattern, nodes=None, start=0):
        """Lines from `nodes` (default: all) matching `pattern`, from index `start`; under cond."""
        rx = re.compile(pattern)
        return [(n, line) for n, line in self.lines[start:]
                if (nodes is None or n in nodes) and rx.search(line)]

    def mark(self):
        with self.cond:
            return len(self.lines)

    def kill_node(self, name):
        """SIGKILL to the agent and its workers' process groups at once: a node that dies."""
        self.say("kill %s without warning (SIGKILL to its agent and workers)" % name)
        self.procs[name].kill_node(signal.SIGKILL)

    def wait_exit(self, name, timeout):
        try:
            return self.procs[name].proc.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            raise DemoError("node %s still running after %d s" % (name, timeout)) from None

    def close(self):
        for p in self.procs.values():
            p.close()
        self.procs = {}
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_example(name, body):
    """Runs body(job) with a LocalJob; returns the exit code (0, 1 on failure, 130 on Ctrl-C)."""
    def on_term(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)
    job = None
    try:
        job = LocalJob(name)
        job.start_etcd()
        body(job)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process this example started", file=sys.stderr)
        return 130
    except DemoError as e:
        print("%s failed: %s" % (name, e), file=sys.stderr)
        return 1
    finally:
        if job is not None:
            job.close()
