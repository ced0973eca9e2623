"""The node agent persists its workers' snapshots (docs/snapshots.md, "The agent persists"),
through the real `efdl run` binary on a real etcd: the worker runs without a persister thread,
and SIGTERM to the agent writes the worker's final commit to storage before the agent exits.

Every process runs in its own session and is killed by process group when the test ends.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from cluster import PYTHON, base_env, efdl_bin, running, wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(efdl_bin() is None, reason="efdl binary not built (set EFDL_BIN)")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "suspend_worker.py")


@pytest.fixture
def cluster(tmp_path):
    with running("persist-%d-%d" % (os.getpid(), time.monotonic_ns() % 100000)) as c:
        yield c


def start_time(pid):
    with open("/proc/%d/stat" % pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def thread_names(pid):
    names = set()
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                names.add(f.read().strip())
        except OSError:
            pass
    return names


def stored_steps(cluster, snapshot_dir):
    out = subprocess.run([efdl_bin(), "snapshots", "list", "--json", "--job", cluster.job,
                          "--snapshot-dir", snapshot_dir], env=base_env(),
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        # No job directory yet, or one the persister created whose first file is not in place.
        assert ("no snapshots for job" in out.stderr or "has no snapshots in" in out.stderr), (
            out.stdout + out.stderr)
        return []
    return [row["step"] for row in json.loads(out.stdout) if row.get("ok")]


def test_the_agent_persists_and_sigterm_stores_the_final_commit(cluster, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    storage = str(tmp_path / "storage")
    # Far beyond the test: after the first write only the agent's stop can persist.
    env = {"EFDL_SHM_DIR": str(shm), "EFDL_PERSIST_MIN_INTERVAL_MS": "600000",
           "SUSPEND_WORKER_MB": "1"}
    agent = cluster.start_agent("a", env=env, nnodes="1:1", command=[PYTHON, WORKER],
                                snapshot_dir=storage)
    wait_for(lambda: any(s[4] >= 20 for s in agent.steps()), 120, "step 20")
    # The worker, not the pre-started spare forked after it was activated: the older one.
    workers = sorted(agent.worker_pids(), key=start_time)[:1]
    assert len(workers) == 1, agent.output()[-3000:]
    with open("/proc/%d/environ" % workers[0], "rb") as f:
        assert b"EFDL_AGENT_PERSISTS=1" in f.read().split(b"\0")
    assert "efdl-persist" not in thread_names(workers[0])
    assert "efdl-persist" in thread_names(agent.proc.pid)
    # The background persister's first write; the rate limit then holds back every later one.
    early = max(wait_for(lambda: stored_steps(cluster, storage), 60, "the first persisted step"))
    wait_for(lambda: any(s[4] >= early + 10 for s in agent.steps()), 120, "10 more steps")
    assert max(stored_steps(cluster, storage)) == early

    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(60) == 128 + signal.SIGTERM, agent.output()[-3000:]
    m = wait_for(lambda: re.search(r"rank 0 stopping after step (\d+)", agent.output()), 10,
                 "the worker's stopping line")
    final = int(m.group(1))
    assert final >= early + 10 and final == max(s[4] for s in agent.steps()), agent.output()[-3000:]
    assert max(stored_steps(cluster, storage)) == final, agent.output()[-3000:]
