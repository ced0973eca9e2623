"""The tests' cluster harness, for tests/python and tests/faults (faultlib.Job is built on it):
real etcd members (Etcd), `efdl run` agents whose output is collected line by line with the
time each line arrived (Agent), a loopback job of them (Cluster), jobs on the hosts of
workers/hosts.py (host_world, bridge_etcd, start_host_agent), and waiting for conditions
instead of sleeping (poll_until, wait_for, wait_for_output, wait_for_world).

Every process it starts leads its own session (process group) and is killed by pid/group when
the cluster (or host world) is closed, whatever the test did.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request

# The process names (ps -o comm) of an agent's children that are neither workers nor spares:
# src/common/group_reaper.h, src/agent/zygote.h and src/agent/agent_store.h.
AGENT_HELPERS = ("efdl-reaper", "efdl-zygote", "efdl-store")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
PYTHON = "/usr/bin/python3"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allreduce_worker.py")
# A worker's step line, with the agent's "[rank N] " prefix (efdl) or without (torchrun).
# The worker of jobs on hosts: plain DDP, no efdl import.
HOST_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_plain_worker.py")
STEP_RE = re.compile(r"^(?:\[rank \d+\] )?STEP round=(\d+) rank=(\d+) world=(\d+) step=(\d+)")


# The tests' one place for the interpreter (the one with the Debian torch, never the first
# python3 on PATH), the efdl binary, free ports, waiting, etcd and agents' output: tests/python
# (conftest.py too) and tests/faults (faultlib.py, on sys.path from there) take them from here.
def efdl_bin():
    path = os.environ.get("EFDL_BIN") or os.path.join(REPO, "build", "efdl")
    return path if os.path.exists(path) else None


def alive(pid):
    """True while process `pid` exists and is not a zombie (an unreaped dead process)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port(addr="127.0.0.1"):
    """A TCP port free on `addr` right now."""
    import socket
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(job):
    """A Cluster for job `job` with its etcd started, closed at the end (agents stopped, etcd
    stopped, its directory removed): a test file's fixture is `with running(...) as c: yield c`."""
    c = Cluster(job=job)
    try:
        c.start_etcd()
        yield c
    finally:
        c.close()


def etcd_argv(name, data_dir, endpoint, peer_port, scheme="http", initial_cluster=None):
    """The command line of etcd member `name` with its data in `data_dir`, serving clients on
    `endpoint` (HOST:PORT, over `scheme`) and its peers on 127.0.0.1:`peer_port`: alone in its
    cluster, or a member of the new cluster `initial_cluster` ("name=url,...")."""
    peer = "http://127.0.0.1:%d" % peer_port
    argv = ["etcd", "--name", name, "--data-dir", data_dir,
            "--listen-client-urls", "%s://%s" % (scheme, endpoint),
            "--advertise-client-urls", "%s://%s" % (scheme, endpoint),
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", initial_cluster or "%s=%s" % (name, peer)]
    if initial_cluster:
        argv += ["--initial-cluster-state", "new"]
    return argv


def base_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EFDL_", "WORKER_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    env["OMP_NUM_THREADS"] = "1"
    return env


def off_loopback(env):
    """`env` (changed in place and returned) for a process on a workers/hosts.py host: without
    this machine's network interface choices (loopback runs) and TMPDIR (a host has its own
    /tmp)."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "TMPDIR"):
        env.pop(name, None)
    return env



def poll_until(predicate, timeout, interval=0.05):
    """The tests' one wait-until-deadline loop: calls predicate() every `interval` seconds
    until it returns a true value, which is returned; None once `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(interval)


def wait_for(predicate, timeout, what, output=None, interval=0.05, fail=None):
    """poll_until() that fails: after `timeout` seconds naming `what`, followed by output()
    when given (the processes' output, for the failure message); at once when fail() (called
    before each try) returns a line saying why waiting is pointless (an agent exited)."""
    why = []

    def check():
        why[:] = [fail()] if fail is not None else []
        return True if why and why[0] else predicate()
    value = poll_until(check, timeout, interval)
    if why and why[0]:
        raise AssertionError("%s while waiting for %s%s" % (
            why[0], what, "\n" + output() if output else ""))
    if value is None:
        raise AssertionError("timed out after %ss waiting for %s%s" % (
            timeout, what, "\n" + output() if output else ""))
    return value


def exited(agents):
    """For wait_for(fail=...): a line naming the first of `agents` that exited, else None."""
    def check():
        for a in agents:
            if a.proc.poll() is not None:
                return "agent %s exited (%s)" % (a.name, a.proc.poll())
        return None
    return check


def outputs(agents, tail=4000, own=False):
    """The agents' outputs (the last `tail` characters of each; own: their own lines only),
    for a failure message."""
    return "\n----\n".join("%s (exit %s):\n%s" % (
        a.name, a.proc.poll(), (a.own_output() if own else a.output())[-tail:]) for a in agents)


def wait_for_output(agent, text, timeout=90):
    """Waits until `agent` printed `text`; fails with its output if it exits or `timeout`
    seconds pass first."""
    wait_for(lambda: text in agent.output(), timeout, "%s to print %r" % (agent.name, text),
             output=lambda: agent.output()[-3000:], fail=exited([agent]))


def wait_for_log(agent, pattern, timeout, agents=()):
    """Waits until the agent's own lines match the regular expression `pattern` (re.search,
    multi-line text); returns the match. Fails when it exits first, or after `timeout`
    seconds, with the own lines of `agents` (default: of `agent`)."""
    return wait_for(lambda: re.search(pattern, agent.own_output()), timeout,
                    "%s to log %r" % (agent.name, pattern),
                    output=lambda: outputs(agents or [agent], 3000, own=True),
                    fail=exited([agent]))


def wait_for_world(agents, world, since=0.0, timeout=60, full=True, by_round=True, live=(),
                   steps=None):
    """Waits until some round of world size `world` ran a step on every one of its ranks
    (full) after `since`, in the STEP lines of `agents`; returns the time of the first such
    step. by_round=False: ranks of any round count (torchrun has no shared round number).
    Fails at once when an agent of `live` exits. steps: steps(agent) gives the (time, rank,
    round, world, ...) of each step line of a worker printing other lines than STEP_RE's."""
    def found():
        rounds = {}
        for a in agents:
            for t, rank, round_, w, *_ in (steps(a) if steps else a.steps(since)):
                if w == world and t >= since:
                    rounds.setdefault(round_ if by_round else 0, {}).setdefault(rank, t)
        for ranks in rounds.values():
            if not full or len(ranks) == world:
                return min(ranks.values())
        return None
    return wait_for(found, timeout, "a round of world %d" % world,
                    output=lambda: outputs(agents, 3000), fail=exited(live))


# -- etcd --------------------------------------------------------------------------------------

def etcd_healthy(endpoint):
    """True when the etcd at `endpoint` (HOST:PORT) answers its /health with true."""
    try:
        with urllib.request.urlopen("http://%s/health" % endpoint, timeout=1) as r:
            return b"true" in r.read()
    except OSError:
        return False


class Etcd:
    """One real etcd member, leading its own process group: data in `data_dir`, output in
    `log`, clients on HOST:<free port> (`endpoint`), peers on 127.0.0.1:<free port>; alone in
    its cluster, or a member of the new cluster `initial_cluster` ("name=url,...", with its
    `peer_port`). Started at once; wait=True: returns once healthy."""

    def __init__(self, data_dir, log, name="e2e", host="127.0.0.1", peer_port=None,
                 initial_cluster=None, extra=(), timeout=30, wait=True):
        self.endpoint = "%s:%d" % (host, free_port())
        self.log = log
        self.args = etcd_argv(name, data_dir, self.endpoint, peer_port or free_port(),
                              initial_cluster=initial_cluster) + list(extra)
        self.proc = None
        self.start("w", timeout if wait else None)

    @property
    def pid(self):
        return self.proc.pid

    def start(self, mode="a", timeout=30):
        """Starts the member (again: same ports, data and log); waits until it is healthy
        unless timeout is None."""
        with open(self.log, mode) as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        if timeout is not None:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout=30):
        wait_for(lambda: etcd_healthy(self.endpoint), timeout,
                 "etcd %s to become healthy" % self.endpoint, interval=0.1)

    def kill(self):
        """SIGKILLs the member's process group and reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()

    close = kill


class Agent:
    def __init__(self, name, argv, env):
        self.name = name
        self.lines = []                  # (monotonic time, text)
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def output(self):
        with self._lock:
            return "\n".join(text for _, text in self.lines)

    def own_output(self):
        """The agent's own log lines, without its workers' ("[rank N] ...")."""
        return "\n".join(line for line in self.output().splitlines()
                         if not line.startswith("[rank"))

    def steps(self, since=0.0):
        """(time, rank, round, world, step) of every STEP line after `since`."""
        with self._lock:
            lines = list(self.lines)
        out = []
        for t, text in lines:
            m = STEP_RE.match(text)
            if m and t >= since:
                out.append((t, int(m.group(2)), int(m.group(1)), int(m.group(3)),
                            int(m.group(4))))
        return out

    def worker_pids(self):
        """Pids of the agent's live children but its helpers (the group reaper, named
        efdl-reaper, the zygote, efdl-zygote, and the agent store, efdl-store): its workers and
        pre-started spares.

        A child still named like the agent has neither exec'd nor named itself yet: it may be a
        helper in its first microseconds (the reaper is forked before anything else), so it
        is not counted - "a worker runs" must not be seen before the agent got that far."""
        own = self._comm(self.proc.pid)
        return [pid for pid in self._children()
                if self._comm(pid) not in AGENT_HELPERS + (own,)]

    def zygote_pids(self):
        """Pids of the agent's live zygote (efdl-zygote); empty without one."""
        return self.helper_pids("efdl-zygote")

    def helper_pids(self, name):
        """Pids of the agent's live children named `name` (one of AGENT_HELPERS)."""
        return [pid for pid in self._children() if self._comm(pid) == name]

    def _children(self):
        out = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                out.append(int(entry))
        return out

    @staticmethod
    def _comm(pid):
        try:
            with open("/proc/%d/comm" % pid) as f:
                return f.read().strip()
        except OSError:
            return None

    def signal_group(self, sig):
        """`sig` to the agent's process group and to each worker's (they lead their own)."""
        groups = {self.proc.pid} | set(self.worker_pids())
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("agent %s still running after %ss; output:\n%s" %
                                 (self.name, timeout, self.output()[-4000:]))

    def kill(self):
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)
            self.signal_group(signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=5)


class Cluster:
    def __init__(self, job="e2e"):
        self.dir = tempfile.mkdtemp(prefix="efdl-e2e-")
        self.job = job
        self.started = time.time()
        self.agents = []
        self.etcd = None
        self.endpoint = None

    def start_etcd(self, enable_v2=False):
        self.etcd = Etcd(os.path.join(self.dir, "etcd"), os.path.join(self.dir, "etcd.log"),
                         extra=["--enable-v2"] if enable_v2 else ())
        self.endpoint = self.etcd.endpoint
        return self.endpoint

    def agent_argv(self, node_id, nnodes="2:3", nproc=1, extra=(), command=None,
                   snapshot_dir=None, ttl=3):
        """snapshot_dir: this node's storage (default: one directory shared by all nodes)."""
        argv = [efdl_bin(), "run", "--etcd", self.endpoint, "--job", self.job,
                "--nnodes", nnodes, "--node-id", node_id, "--nproc-per-node", str(nproc),
                "--ttl", str(ttl), "--last-call", "1", "--stop-grace", "3",
                "--snapshot-dir", snapshot_dir or os.path.join(self.dir, "snapshots")]
        argv += list(extra)
        argv += ["--"] + (command or [PYTHON, WORKER])
        return argv

    @property
    def tmp_dir(self):
        """The agents' TMPDIR: a SIGKILLed agent leaves its private directory (efdl-agent-*)
        behind, here rather than in this machine's /tmp; removed with the cluster."""
        path = os.path.join(self.dir, "tmp")
        os.makedirs(path, exist_ok=True)
        return path

    def start_agent(self, node_id, env=None, host=None, prefix=(), **kwargs):
        """`efdl run` for node `node_id` (agent_argv's kwargs), `env` over base_env(). host: a
        workers/hosts.py Host to run it in (its own network, name, /dev/shm and /tmp; default
        network flags, working directory this cluster's) instead of this machine's loopback;
        prefix: a command line the agent's is appended to (e.g. a cgroup's)."""
        e = base_env()
        if host is None:
            e["TMPDIR"] = self.tmp_dir   # a killed agent's own directory stays in the cluster's
        else:
            off_loopback(e)
            prefix = host.enter_prefix(self.dir)
        e.update(env or {})
        agent = Agent(node_id, list(prefix) + self.agent_argv(node_id, **kwargs), e)
        self.agents.append(agent)
        return agent

    def wait_joined(self, agent, timeout=90):
        """Waits until `agent` logged that it joined the job (by default only after its
        pre-started workers imported torch: tens of seconds on a loaded machine)."""
        wait_for_output(agent, " joined job ", timeout)

    def world_sizes_since(self, since, agents=None):
        """The set of world sizes seen in STEP lines after `since`."""
        return {s[3] for a in (agents or self.agents) for s in a.steps(since)}

    def wait_for_world(self, world, since=0.0, agents=None, timeout=60, full=True,
                       by_round=True):
        """wait_for_world() over this cluster's agents (or `agents`)."""
        return wait_for_world(agents or self.agents, world, since, timeout, full, by_round)

    def close(self):
        for a in self.agents:
            a.kill()
        if self.etcd is not None:
            self.etcd.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        # A killed agent leaves its holder lock (and arenas) in /dev/shm for the node's next
        # agent to adopt; no agent of this job comes again. Only what this cluster's run made.
        shm = os.environ.get("EFDL_SHM_DIR") or "/dev/shm"
        for name in os.listdir(shm) if os.path.isdir(shm) else []:
            path = os.path.join(shm, name)
            try:
                if (name.startswith("efdl-%s-" % self.job)
                        and os.lstat(path).st_mtime >= self.started - 1):
                    os.unlink(path)
            except OSError:
                pass


# -- jobs on the hosts of workers/hosts.py ------------------------------------------------------

def bridge_etcd(world):
    """A real etcd listening on a HostWorld's bridge (the root namespace side)."""
    return Etcd(os.path.join(world.dir, "etcd"), os.path.join(world.dir, "etcd.log"),
                name="hosts", host=world.bridge_addr)


def host_env(extra=None):
    env = off_loopback(base_env())
    env["WORKER_STEP_TIME"] = "0.2"
    env.update(extra or {})
    return env


def start_host_agent(world, etcd, host, job, extra=(), env=None, command=None, nnodes="2:3"):
    """`efdl run` with default flags on `host`, its working directory on the shared disk."""
    cwd = os.path.join(world.shared, host.name)
    os.makedirs(cwd, exist_ok=True)
    argv = host.enter_prefix(cwd) + [efdl_bin(), "run", "--etcd", etcd.endpoint,
                                     "--job", job, "--nnodes", nnodes] + list(extra) + [
        "--"] + (command or [PYTHON, HOST_WORKER])
    return Agent(host.name, argv, host_env(env))


def host_world(n=3):
    """A fixture body (`world = pytest.fixture(cluster.host_world)`): yields (a HostWorld of n
    hosts, its bridge_etcd, the list the test appends its agents to); afterwards the hosts, the
    agents and etcd are killed, the world closed, and nothing of it may be left."""
    import hosts
    w = hosts.HostWorld(n)
    agents = []
    etcd = None
    try:
        etcd = bridge_etcd(w)
        yield w, etcd, agents
    finally:
        try:
            for h in w.hosts:
                h.kill()
            for a in agents:
                a.kill()
            if etcd is not None:
                etcd.close()
        finally:
            w.close()
        assert w.leftovers() == [], w.leftovers()
