"""The private etcd of `efdl run` without --etcd and of `efdl sim` (issue #38): its data directory
(TMPDIR/efdl-etcd-XXXXXX, 123 MB: etcd 3.4 preallocates its write-ahead log) goes however the
command dies. A SIGKILL leaves nothing once the command's reaper did its work (a bounded wait);
a directory left anyway (the reaper killed too) is swept by the next run and listed and removed
by `efdl snapshots gc`; the directory of a running command is never touched.

Every test gives the commands a TMPDIR of its own, which is where they make these directories,
so what other tests on this machine run at the same time cannot confuse the checks."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

EFDL = cluster.efdl_bin()
pytestmark = pytest.mark.skipif(EFDL is None, reason="efdl binary not built (set EFDL_BIN)")

REAPER_WAIT = 15   # seconds: the reaper kills etcd, waits until it is gone, then removes the dir

SLEEPER = "import time; open('ready', 'w').close(); time.sleep(600)"


def etcd_dirs(tmp):
    return sorted(os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("efdl-etcd-"))


def owner_pid(path):
    with open(os.path.join(path, "efdl-owner")) as f:
        return int(f.read().split()[1])


def proc_field(pid, name):
    try:
        with open("/proc/%d/%s" % (pid, name), "rb") as f:
            return f.read()
    except OSError:
        return None


def etcd_of(path):
    """The pids of etcd processes whose data directory is inside `path`."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            cmd = proc_field(int(name), "cmdline") or b""
            if (b"etcd" in cmd and (path + "/member-data").encode() in cmd
                    and cluster.alive(int(name))):
                pids.append(int(name))
    return pids


def reapers_of(pid):
    """The efdl-reaper children of `pid` (its private etcd's, and an agent's)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_field(int(name), "stat")
            if stat and b"(efdl-reaper)" in stat and \
                    int(stat.rsplit(b")", 1)[1].split()[1]) == pid:
                out.append(int(name))
    return out


class Commands:
    """The efdl commands a test starts, each in a session of its own; killed (by process group)
    at the end if still running."""

    def __init__(self, tmp_path):
        self.root = tmp_path
        self.tmp = str(tmp_path / "tmp")
        os.makedirs(self.tmp)
        self.env = cluster.base_env()
        self.env["TMPDIR"] = self.tmp
        self.env["EFDL_SHM_DIR"] = str(tmp_path / "shm")
        os.makedirs(self.env["EFDL_SHM_DIR"])
        self.procs = []

    def start(self, args, cwd):
        os.makedirs(cwd, exist_ok=True)
        proc = subprocess.Popen([EFDL] + args, env=self.env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_run(self, name):
        """`efdl run` without --etcd of a python program that sleeps once it started; returns
        the process and its private etcd's directory."""
        cwd = self.root / name
        proc = self.start(["run", "--no-prestart", "--", sys.executable, "-c", SLEEPER], cwd)
        cluster.wait_for(lambda: (cwd / "ready").exists() or proc.poll() is not None, 120,
                         "the run's program never started")
        assert proc.poll() is None, proc.communicate()[0]
        mine = [d for d in etcd_dirs(self.tmp) if owner_pid(d) == proc.pid]
        assert len(mine) == 1, (etcd_dirs(self.tmp), proc.pid)
        return proc, mine[0]

    def run(self, args, timeout=180):
        proc = subprocess.run([EFDL] + args, env=self.env, cwd=self.root, capture_output=True,
                              text=True, timeout=timeout)
        return proc

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture
def commands(tmp_path):
    c = Commands(tmp_path)
    yield c
    c.close()


def sigkill(proc):
    proc.kill()
    proc.wait()


def test_a_sigkilled_run_without_etcd_leaves_nothing_in_tmp(commands):
    proc, path = commands.start_run("run")
    etcd = etcd_of(path)
    assert etcd, "no etcd serves from %s" % path
    sigkill(proc)
    cluster.wait_for(lambda: not os.path.exists(path), REAPER_WAIT,
                     "%s outlived the SIGKILLed efdl run" % path)
    assert not any(cluster.alive(p) for p in etcd), "the private etcd outlived its run"
    assert etcd_dirs(commands.tmp) == []
    # The next run leaves nothing either.
    done = commands.run(["run", "--no-prestart", "--", "true"])
    assert done.returncode == 0, done.stderr
    assert etcd_dirs(commands.tmp) == []


def test_a_sigkilled_sim_leaves_nothing_in_tmp(commands):
    # Large enough to still run when its etcd is ready (the owner file is written then).
    proc = commands.start(["sim", "--nodes", "20000"], commands.root / "sim")

    def started():
        assert proc.poll() is None, proc.communicate()[0]
        return [d for d in etcd_dirs(commands.tmp)
                if os.path.exists(os.path.join(d, "efdl-owner"))]
    cluster.wait_for(started, 60, "efdl sim never started its private etcd")
    path = started()[0]
    assert owner_pid(path) == proc.pid
    etcd = etcd_of(path)
    sigkill(proc)
    cluster.wait_for(lambda: not os.path.exists(path), REAPER_WAIT,
                     "%s outlived the SIGKILLed efdl sim" % path)
    assert not any(cluster.alive(p) for p in etcd), "the private etcd outlived efdl sim"
    done = commands.run(["sim", "--nodes", "5", "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert etcd_dirs(commands.tmp) == []


def test_what_a_killed_reaper_left_is_swept_but_never_a_live_runs(commands):
    live, live_path = commands.start_run("live")
    dead, dead_path = commands.start_run("dead")
    # Its reapers first (a machine-wide kill, say): then nothing removes its directory at once.
    reapers = reapers_of(dead.pid)
    assert len(reapers) == 2, reapers     # the private etcd's and the agent's
    for pid in reapers:
        os.kill(pid, signal.SIGKILL)
    sigkill(dead)
    cluster.wait_for(lambda: not etcd_of(dead_path), 10, "the killed run's etcd lives on")
    time.sleep(1)
    assert os.path.exists(dead_path), "this test made no stale directory"

    # `efdl snapshots gc --dry-run` names it, and only it.
    listed = commands.run(["snapshots", "gc", "--dry-run", "--json"])
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    assert report["etcd_dirs"] == [dead_path], report
    assert report["etcd_bytes"] > 0
    assert os.path.exists(dead_path)

    # The next run sweeps it; the live run's directory stays, and the live run goes on.
    done = commands.run(["run", "--no-prestart", "--", "true"])
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(dead_path), done.stderr
    assert "efdl-etcd" in done.stderr and "died" in done.stderr, done.stderr
    assert etcd_dirs(commands.tmp) == [live_path]
    assert live.poll() is None and etcd_of(live_path)

    # `efdl snapshots gc` removes a dead owner's directory and keeps the live one's too.
    fake = os.path.join(commands.tmp, "efdl-etcd-gone01")
    os.makedirs(fake)
    with open(os.path.join(fake, "efdl-owner"), "w") as f:
        f.write("pid %d start 1 efdl\n" % dead.pid)
    gc = commands.run(["snapshots", "gc"])
    assert gc.returncode == 0, gc.stderr
    assert "removed %s" % fake in gc.stdout, gc.stdout
    assert "removed 1 private etcd directory" in gc.stdout, gc.stdout
    assert etcd_dirs(commands.tmp) == [live_path]
    assert live.poll() is None

    # Stopped in order (SIGTERM), the live run removes its own.
    live.terminate()
    assert live.wait(timeout=60) == 128 + signal.SIGTERM
    assert etcd_dirs(commands.tmp) == []
