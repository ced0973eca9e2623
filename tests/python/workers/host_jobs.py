"""Jobs on the hosts of workers/hosts.py: a real etcd on the world's bridge, `efdl run` with
default flags on a host, waits on the workers' STEP lines, and the `world` fixture body (a
HostWorld of 3 hosts, etcd, and the agents a test started, all removed whatever happens).

Used by tests/python/test_e2e_hosts.py, test_metrics.py and test_ledger.py (`world =
pytest.fixture(host_jobs.world)`), and test_slurm.py (its site etcd is `Etcd`).
"""

import os
import subprocess
import time
import urllib.request

import cluster
import hosts

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_plain_worker.py")


class Etcd:
    """A real etcd listening on the world's bridge (the root namespace side)."""

    def __init__(self, world):
        client, peer = cluster.free_port(), cluster.free_port()
        self.endpoint = "%s:%d" % (world.bridge_addr, client)
        data = os.path.join(world.dir, "etcd")
        self.log = os.path.join(world.dir, "etcd.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cluster.etcd_argv("hosts", data, self.endpoint, peer),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        cluster.wait_for(self._healthy, 30, "etcd on the bridge to become healthy")

    def _healthy(self):
        try:
            with urllib.request.urlopen("http://%s/health" % self.endpoint, timeout=1) as r:
                return b"true" in r.read()
        except OSError:
            return False

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def host_env(extra=None):
    env = cluster.base_env()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "TMPDIR"):
        env.pop(name, None)
    env["WORKER_STEP_TIME"] = "0.2"
    env.update(extra or {})
    return env


def start_agent(world, etcd, host, job, extra=(), env=None, command=None, nnodes="2:3"):
    """`efdl run` with default flags on `host`, its working directory on the shared disk."""
    cwd = os.path.join(world.shared, host.name)
    os.makedirs(cwd, exist_ok=True)
    argv = host.enter_prefix(cwd) + [cluster.efdl_bin(), "run", "--etcd", etcd.endpoint,
                                     "--job", job, "--nnodes", nnodes] + list(extra) + [
        "--"] + (command or [cluster.PYTHON, WORKER])
    return cluster.Agent(host.name, argv, host_env(env))


def outputs(agents):
    return "\n----\n".join("%s (exit %s):\n%s" % (a.name, a.proc.poll(), a.output()[-4000:])
                           for a in agents)


def wait_world(agents, world_size, since, timeout, live):
    """Waits until one round of `world_size` ran a step on each of its ranks after `since`;
    fails at once when an agent of `live` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds = {}
        for a in agents:
            for _, rank, round_, w, _step in a.steps(since):
                if w == world_size:
                    rounds.setdefault(round_, set()).add(rank)
        if any(len(r) == world_size for r in rounds.values()):
            return
        for a in live:
            if a.proc.poll() is not None:
                raise AssertionError("agent %s exited (%s) before world %d formed:\n%s" % (
                    a.name, a.proc.poll(), world_size, outputs(agents)))
        time.sleep(0.1)
    raise AssertionError("no round of world %d within %ss:\n%s" % (world_size, timeout,
                                                                 outputs(agents)))


def world():
    w = hosts.HostWorld(3)
    agents = []
    etcd = None
    try:
        etcd = Etcd(w)
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
