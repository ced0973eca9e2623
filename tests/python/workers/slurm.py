"""A real Slurm cluster on the hosts of a HostWorld (tests/python/workers/hosts.py).

SlurmCluster(world) starts, from Debian's slurm-wlm and munge packages:
  - munged, with its own key, socket, pid, log and seed files in the cluster's directory (under
    the world's directory in /var/tmp, which every host sees at the same path). One munged serves
    every host: a unix socket in the file system reaches across network namespaces, and on a
    real cluster every node's munged holds the same key anyway;
  - slurmctld in the root namespace, listening on the world's bridge address on a free port
    (SlurmctldHost names this machine's host name with the bridge address);
  - one slurmd per host, inside that host's namespaces (started with Host.popen, so a host's
    kill() takes its slurmd and every step of it along), with the host's name as NodeName, its
    bridge address as NodeAddr, and its own spool directory (SlurmdSpoolDir .../spool/%n);
  - one partition `efdl` over all of them (Default=YES).

Without cgroups: ProctrackType=proctrack/linuxproc (a step's processes are found by their
parent chain), TaskPlugin=task/none, JobAcctGatherType=jobacct_gather/none. The test machines
have no delegated cgroup hierarchy for slurmd, and nothing here needs resource limits; a process
that double-forks out of its parent chain would escape Slurm's signals (EFDL's do not: the
agent's workers are its children, its reaper kills their process groups).

close() stops the daemons (SIGTERM, then SIGKILL after a bound), kills whatever process the
jobs left on the hosts (by killing the hosts' processes other than their init: only processes of
this world), and removes the cluster's directory. It does not close the world.

Needs root, slurmctld, slurmd, sbatch and munged (scripts/install-deps installs them);
SlurmCluster.unavailable() says in one line why a cluster cannot be started here.
"""

import os
import re
import shutil
import signal
import socket
import subprocess

import cluster
from hosts import _wait_gone as hosts_wait_gone

_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol", "squeue", "munged")


def _stop(proc, timeout=15):
    """SIGTERM, then SIGKILL, to a Popen (and its process group when it leads one)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


class SlurmCluster:
    """Slurm over the hosts of `world`; see the module's docstring. Use as a context manager or
    call close()."""

    def __init__(self, world, slurmd_timeout=10, kill_wait=5, hosts=None):
        self.world = world
        self.hosts = list(world.hosts if hosts is None else hosts)
        self.dir = os.path.join(world.dir, "slurm")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.partition = "efdl"
        self._munged = None
        self._slurmctld = None
        self._slurmd = {}           # host name -> Popen (of nsenter, which waits for slurmd)
        try:
            os.makedirs(self.dir, mode=0o755)
            for sub in ("munge", "state", "spool", "log"):
                os.makedirs(os.path.join(self.dir, sub), mode=0o700 if sub == "munge" else 0o755)
            self._start_munge()
            self.port = cluster.free_port(world.bridge_addr)
            self._write_conf(slurmd_timeout, kill_wait)
            self._start_slurmctld()
            for h in self.hosts:
                self.start_slurmd(h)
            self.wait_nodes_idle([h.name for h in self.hosts], timeout=60)
        except BaseException:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------------

    @staticmethod
    def unavailable():
        missing = [t for t in _TOOLS if shutil.which(t) is None and
                   not os.path.exists(os.path.join("/usr/sbin", t))]
        if missing:
            return ("Slurm needs %s (apt-get install slurmctld slurmd slurm-client munge, or "
                    "scripts/install-deps)" % ", ".join(missing))
        return None

    def _start_munge(self):
        d = os.path.join(self.dir, "munge")
        self.munge_socket = os.path.join(d, "munge.socket")
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o400)
        self._munged = subprocess.Popen(
            ["munged", "--foreground", "--force", "--socket", self.munge_socket,
             "--key-file", key, "--pid-file", os.path.join(d, "munged.pid"),
             "--log-file", os.path.join(self.dir, "log", "munged.log"),
             "--seed-file", os.path.join(d, "munged.seed"), "--num-threads", "4"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        self._wait(lambda: os.path.exists(self.munge_socket), 20, "munged's socket",
                   self._munged)

    def _write_conf(self, slurmd_timeout, kill_wait):
        d = self.dir
        lines = [
            "ClusterName=efdltest",
            "SlurmctldHost=%s(%s)" % (socket.gethostname().split(".")[0],
                                      self.world.bridge_addr),
            "SlurmctldPort=%d" % self.port,
            "SlurmdPort=6818",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again
            # (120 s by default); 15 s keeps the requeue case short.
            "AuthInfo=socket=%s,cred_expire=15" % self.munge_socket,
            "StateSaveLocation=%s" % os.path.join(d, "state"),
            "SlurmdSpoolDir=%s" % os.path.join(d, "spool", "%n"),
            "SlurmctldPidFile=%s" % os.path.join(d, "slurmctld.pid"),
            "SlurmdPidFile=%s" % os.path.join(d, "spool", "slurmd-%n.pid"),
            "SlurmctldLogFile=%s" % os.path.join(d, "log", "slurmctld.log"),
            "SlurmdLogFile=%s" % os.path.join(d, "log", "slurmd-%n.log"),
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups (see the module's docstring).
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/linear",
            "MailProg=/bin/true",
            # A node that stops answering is DOWN after SlurmdTimeout; one that comes back
            # (its slurmd restarted) is usable again.
            "SlurmdTimeout=%d" % slurmd_timeout,
            "SlurmctldTimeout=30",
            "ReturnToService=2",
            "MessageTimeout=5",
            "KillWait=%d" % kill_wait,
            "InactiveLimit=0",
            "MinJobAge=300",
            "JobRequeue=1",
            "TmpFS=/tmp",
        ]
        for h in self.hosts:
            lines.append("NodeName=%s NodeAddr=%s CPUs=1 State=UNKNOWN" % (h.name, h.addr))
        lines.append("PartitionName=%s Nodes=%s Default=YES MaxTime=INFINITE State=UP" % (
            self.partition, ",".join(h.name for h in self.hosts)))
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        for h in self.hosts:
            os.makedirs(os.path.join(d, "spool", h.name), exist_ok=True)
        # slurmd 22.05 loads a cgroup plugin at start whatever the other plugins are; autodetect
        # fails where /sys/fs/cgroup is a tmpfs of v1 hierarchies beside an unmounted-looking v2
        # (the test machines). The v1 plugin only checks its mount point here: with
        # proctrack/linuxproc and task/none no job is put in a cgroup.
        with open(os.path.join(d, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                    "ConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n")

    def _start_slurmctld(self):
        self._slurmctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", self.conf],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, env=self.env())
        self._wait(lambda: self.scontrol("ping").returncode == 0 and
                   "UP" in self.scontrol("ping").stdout, 30, "slurmctld to answer",
                   self._slurmctld)

    def start_slurmd(self, host):
        """slurmd inside `host` (again, after the host was killed and started)."""
        old = self._slurmd.get(host.name)
        if old is not None and old.poll() is None:
            raise RuntimeError("slurmd of %s runs already" % host.name)
        self._slurmd[host.name] = host.popen(
            ["slurmd", "-D", "-f", self.conf, "-N", host.name],
            cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=self.env())

    # -- use ---------------------------------------------------------------------------------

    def env(self, extra=None):
        """The environment a Slurm command (or daemon) needs: SLURM_CONF."""
        env = dict(os.environ)
        env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    def _cmd(self, argv, timeout=30, env=None, cwd=None):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=self.env(env), cwd=cwd)

    def scontrol(self, *args):
        return self._cmd(["scontrol"] + list(args))

    def sbatch(self, script, args=(), script_args=(), env=None, cwd=None):
        """Submits `script` with sbatch options `args` and the script's own `script_args`, from
        `cwd` (the submit directory); the Slurm job id."""
        proc = self._cmd(["sbatch", "--parsable"] + list(args) + [script] + list(script_args),
                         env=env, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError("sbatch failed: %s" % (proc.stderr or proc.stdout).strip())
        return proc.stdout.strip().split(";")[0]

    def scancel(self, *args):
        proc = self._cmd(["scancel"] + list(args))
        if proc.returncode != 0:
            raise RuntimeError("scancel %s: %s" % (" ".join(args), proc.stderr.strip()))

    def job(self, job_id):
        """scontrol show job's fields as a dict ({} when the job is unknown)."""
        proc = self.scontrol("show", "job", "-o", str(job_id))
        if proc.returncode != 0:
            return {}
        out = {}
        for m in re.finditer(r"(\S+?)=(\S*)", proc.stdout):
            out.setdefault(m.group(1), m.group(2))
        return out

    def job_state(self, job_id):
        return self.job(job_id).get("JobState", "")

    def nodes(self):
        """{node name: state} from sinfo-like `scontrol show nodes`."""
        proc = self.scontrol("show", "nodes", "-o")
        out = {}
        for line in proc.stdout.splitlines():
            name = re.search(r"NodeName=(\S+)", line)
            state = re.search(r"State=(\S+)", line)
            if name and state:
                out[name.group(1)] = state.group(1)
        return out

    def wait_nodes_idle(self, names, timeout=60):
        def idle():
            states = self.nodes()
            return all(states.get(n, "").split("+")[0] == "IDLE" for n in names)
        self._wait(idle, timeout, "nodes %s to be IDLE" % ", ".join(names), self._slurmctld)

    def wait_job_state(self, job_id, states, timeout):
        """Waits until the job is in one of `states` (e.g. ("RUNNING",)); returns it."""
        seen = [""]

        def reached():
            seen[0] = self.job_state(job_id)
            return seen[0] if seen[0] in states else None
        state = cluster.poll_until(reached, timeout, 0.2)
        if state is None:
            raise AssertionError("Slurm job %s is %s, not %s, after %ss\n%s" % (
                job_id, seen[0] or "unknown", "/".join(states), timeout, self.logs()))
        return state

    def _wait(self, predicate, timeout, what, proc):
        def done():
            if predicate():
                return "done"
            return "exited" if proc is not None and proc.poll() is not None else None
        how = cluster.poll_until(done, timeout, 0.2)
        if how is None:
            raise RuntimeError("no %s within %ss\n%s" % (what, timeout, self.logs()))
        if how == "exited":
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise RuntimeError("waiting for %s: the daemon exited (%s): %s\n%s" % (
                what, proc.returncode, err, self.logs()))

    def logs(self, tail=3000):
        out = []
        log_dir = os.path.join(self.dir, "log")
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
            with open(os.path.join(log_dir, name), errors="replace") as f:
                out.append("--- %s:\n%s" % (name, f.read()[-tail:]))
        return "\n".join(out)

    # -- tear-down ---------------------------------------------------------------------------

    def job_pids(self, host):
        """Pids of `host`'s live processes other than its init and its slurmd: what jobs run
        there. (Zombies are left out: the host's init, a `sleep`, never reaps the orphans it
        adopts; they hold no resources but a pid until the host is killed.)"""
        out = []
        for pid in host.pids():
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)
                comm = fields[0].split("(", 1)[1]
                if comm != "slurmd" and fields[1].split()[0] != "Z":
                    out.append(pid)
            except (OSError, IndexError):
                pass
        return out

    def pids(self):
        """Pids of the daemons this cluster started that still run."""
        procs = [self._munged, self._slurmctld] + list(self._slurmd.values())
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def close(self):
        errors = []
        for proc in self._slurmd.values():
            try:
                _stop(proc)
            except Exception as e:  # noqa: BLE001 - stop the others, report at the end
                errors.append(str(e))
        # Whatever the jobs left on the hosts (slurmstepd and its tasks when a slurmd was
        # killed): every process of each host's PID namespace but its init.
        for h in self.hosts:
            left = h.pids()
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in left:
                if not hosts_wait_gone(pid, 15):
                    errors.append("process %d of %s survived SIGKILL" % (pid, h.name))
        for proc in (self._slurmctld, self._munged):
            try:
                _stop(proc)
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
        for proc in [self._munged, self._slurmctld] + list(self._slurmd.values()):
            if proc is not None and proc.stderr is not None:
                proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("closing the Slurm cluster: " + "; ".join(errors))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
