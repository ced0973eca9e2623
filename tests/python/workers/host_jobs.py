"""Jobs on the hosts of workers/hosts.py: a real etcd on the world's bridge, `efdl run` with
default flags on a host, waits on the workers' STEP lines, and the `world` fixture body (a
HostWorld of 3 hosts, etcd, and the agents a test started, all removed whatever happens).

Used by tests/python/test_e2e_hosts.py, test_metrics.py and test_ledger.py (`world =
pytest.fixture(host_jobs.world)`), and test_slurm.py (its site etcd is `Etcd`).
"""

import os

import cluster
import hosts

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_plain_worker.py")


def Etcd(world):
    """A real etcd listening on the world's bridge (the root namespace side)."""
    return cluster.Etcd(os.path.join(world.dir, "etcd"), os.path.join(world.dir, "etcd.log"),
                        name="hosts", host=world.bridge_addr)


def host_env(extra=None):
    env = cluster.off_loopback(cluster.base_env())
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


outputs = cluster.outputs


def wait_world(agents, world_size, since, timeout, live):
    """Waits until one round of `world_size` ran a step on each of its ranks after `since`;
    fails at once when an agent of `live` exits."""
    return cluster.wait_for_world(agents, world_size, since, timeout, live=live)


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
