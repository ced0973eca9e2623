"""Shared pytest fixtures for the Python package's tests.

Tests use the working tree's EFDL whatever is installed on the machine (`make install`): they
import `efdl` from python/, processes they start get PYTHONPATH=python/ first, EFDL_BIN (the
build tree's efdl, build/efdl unless set) and that directory first on PATH, and
/usr/bin/python3 (the interpreter with the Debian torch), never the first python3 on PATH. The
session stops at once if an interpreter started that way would import efdl from anywhere else.
"""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_DIR = os.path.join(REPO, "python")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from cluster import PYTHON, free_port, wait_for_output  # noqa: E402,F401  (the one place: workers/cluster.py)
import hosts  # noqa: E402

# After the session: the tests' `ip netns add` left no mount of /run/netns behind.
no_netns_mount_left = pytest.fixture(scope="session", autouse=True)(hosts.netns_mount_check())

if sys.path[:1] != [PYTHON_DIR]:
    sys.path.insert(0, PYTHON_DIR)
# What every process a test starts inherits (tests that build their own environment set the
# same): the working tree's package and the build tree's `efdl` ahead of an installed copy.
os.environ.setdefault("EFDL_BIN", os.path.join(REPO, "build", "efdl"))
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != PYTHON_DIR:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [PYTHON_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
_BIN_DIR = os.path.dirname(os.path.abspath(os.environ["EFDL_BIN"]))
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN_DIR:
    os.environ["PATH"] = _BIN_DIR + os.pathsep + os.environ.get("PATH", "")

WORKING_TREE_EFDL = os.path.join(PYTHON_DIR, "efdl", "__init__.py")


def efdl_import_origins():
    """Where `import efdl` resolves here and in a fresh /usr/bin/python3 started, from /, with
    this environment: {"tests": path, "child processes": path}."""
    module = sys.modules.get("efdl")
    here = getattr(module, "__file__", None) if module else importlib.util.find_spec(
        "efdl").origin
    proc = subprocess.run([PYTHON, "-c", "import importlib.util as u; "
                           "print(u.find_spec('efdl').origin)"], cwd="/", capture_output=True,
                          text=True, timeout=60)
    child = proc.stdout.strip() if proc.returncode == 0 else "nowhere (%s)" % (
        proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"tests": here, "child processes": child}


def pytest_sessionstart(session):
    for who, origin in efdl_import_origins().items():
        if os.path.realpath(origin or "") != os.path.realpath(WORKING_TREE_EFDL):
            pytest.exit("conftest: %s would import efdl from %s, not the working tree's %s; "
                        "put %s first on PYTHONPATH" % (who, origin, WORKING_TREE_EFDL,
                                                        PYTHON_DIR), returncode=3)


def pytest_report_header(config):
    return "efdl under test: package %s, command %s (EFDL_BIN)" % (
        os.path.dirname(WORKING_TREE_EFDL), os.environ["EFDL_BIN"])

# Variables through which a launcher or an agent places a process in a job; a test starts its
# processes without them unless it sets them on purpose.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "NODE_RANK", "NNODES", "EFDL_CONTROL_SOCKET", "EFDL_ETCD_ENDPOINTS",
               "EFDL_JOB_ID", "EFDL_REEXECUTED", "EFDL_HOROVOD")


def clean_environment():
    """os.environ minus launcher variables, with PYTHONPATH pointing at the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                      else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_ranks(argv, world_size, started, timeout=60, env=None, rank_env=None):
    """Runs world_size processes of `argv` as ranks of one gloo group on loopback and returns
    their CompletedProcess results in rank order.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (one node
    unless rank_env(rank) returns overrides) on top of clean_environment() and `env`. Waits at
    most `timeout` seconds in all, then kills them. Every process is appended to `started`, so
    the caller can kill leftovers (by pid) if it is interrupted.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        proc_env = clean_environment()
        proc_env.update(env or {})
        proc_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        if rank_env is not None:
            proc_env.update(rank_env(rank))
        procs.append(subprocess.Popen(argv, env=proc_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        started.append(procs[-1])
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            kill_all(procs)
            raise AssertionError("rank processes did not finish within %ss" % timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def kill_all(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def clean_env():
    return clean_environment()


@pytest.fixture
def spawn_ranks():
    """spawn_ranks(argv, world_size, timeout=60, env=None, rank_env=None): run_ranks() whose
    processes are killed when the test ends."""
    started = []

    def spawn(argv, world_size, timeout=60, env=None, rank_env=None):
        return run_ranks(argv, world_size, started, timeout, env, rank_env)

    yield spawn
    kill_all(started)
