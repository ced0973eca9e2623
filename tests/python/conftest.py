"""Shared pytest fixtures for the Python package's tests.

Tests import `efdl` from the source tree (python/); processes they start get the same PYTHONPATH
and /usr/bin/python3 (the interpreter with the Debian torch), never the first python3 on PATH.
"""

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_DIR = os.path.join(REPO, "python")
PYTHON = "/usr/bin/python3"

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

# Variables through which a launcher or an agent places a process in a job; a test starts its
# processes without them unless it sets them on purpose.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "NODE_RANK", "NNODES", "EFDL_CONTROL_SOCKET", "EFDL_ETCD_ENDPOINTS",
               "EFDL_JOB_ID", "EFDL_REEXECUTED", "EFDL_HOROVOD")


def free_port():
    """A TCP port free on loopback right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env():
    """os.environ minus launcher variables, with PYTHONPATH pointing at the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                      else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def spawn_ranks(clean_env):
    """spawn_ranks(argv, world_size, timeout=60, env=None) -> list of CompletedProcess-likes.

    Starts world_size processes of `argv` as ranks of one gloo group on loopback (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), waits for all of
    them at most `timeout` seconds, and kills every one still running at the end (by pid).
    """
    started = []

    def spawn(argv, world_size, timeout=60, env=None):
        port = free_port()
        for rank in range(world_size):
            rank_env = dict(clean_env)
            rank_env.update(env or {})
            rank_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
            started.append(subprocess.Popen(argv, env=rank_env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True))
        results = []
        for proc in started:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in started:
                    p.kill()
                raise AssertionError("rank processes did not finish within %ss" % timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return results

    yield spawn
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
