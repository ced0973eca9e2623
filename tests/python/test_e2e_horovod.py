"""The Horovod examples (examples/hvd_state.py, examples/hvd_native.py) under real `efdl run`
agents on one real etcd: two nodes train, the rank-0 node is SIGKILLed (agent and workers at
once), the survivor goes on alone, a new node joins, and the job finishes with the same
parameters on every rank. `hvd` is EFDL's layer over torch.distributed here (no Horovod).
Skipped when the efdl binary is not built (EFDL_BIN or build/efdl)."""

import os
import re
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402
from conftest import wait_for_output  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

EXAMPLES = os.path.join(cluster.REPO, "examples")
# rank 0's progress line, as the agent prefixes it; both examples print "... world N".
PROGRESS_RE = re.compile(r"^\[rank 0\] epoch \d+ step \d+ .*world (\d+)")
FINAL_RE = re.compile(r"^\[rank (\d+)\] rank \d+ final parameters ([0-9a-f]{16})$", re.M)


def wait_for_world(agent, world, since, timeout=120):
    """Waits until `agent`'s rank 0 printed a progress line at `world` after `since`."""
    def seen():
        with agent._lock:
            lines = [text for t, text in agent.lines if t >= since]
        return any(m and int(m.group(1)) == world for m in map(PROGRESS_RE.match, lines))
    cluster.wait_for(seen, timeout, "%s: a step at world %d" % (agent.name, world),
                     output=lambda: agent.output()[-4000:], fail=cluster.exited([agent]))


@pytest.mark.parametrize("script", ["hvd_state.py", "hvd_native.py"])
def test_horovod_example_survives_a_kill_and_a_join(script, tmp_path):
    (tmp_path / "shm").mkdir()
    job = cluster.Cluster(job="hvd-%s-%d" % (script[:-3].replace("_", "-"), os.getpid()))
    command = [cluster.PYTHON, os.path.join(EXAMPLES, script), "--epochs", "3",
               "--log-interval", "2", "--step-delay", "0.03"]
    env = {"EFDL_SHM_DIR": str(tmp_path / "shm")}
    try:
        job.start_etcd()
        a = job.start_agent("node-a", env=env, nnodes="1:2", command=command)
        wait_for_output(a, "joined job")
        b = job.start_agent("node-b", env=env, nnodes="1:2", command=command)
        wait_for_world(a, 2, since=0.0)

        # The whole rank-0 node (coordinator, master, Horovod rendezvous host) dies at once.
        killed_at = time.monotonic()
        a.signal_group(signal.SIGKILL)
        wait_for_world(b, 1, since=killed_at)
        print("SIGKILL -> node-b trains alone after %.1f s" % (time.monotonic() - killed_at))

        joined_at = time.monotonic()
        c = job.start_agent("node-c", env=env, nnodes="1:2", command=command)
        wait_for_world(b, 2, since=joined_at)
        print("join -> world 2 again after %.1f s" % (time.monotonic() - joined_at))

        codes = [b.wait(timeout=180), c.wait(timeout=60)]
        outputs = {x.name: x.output() for x in (b, c)}
    finally:
        job.close()
    assert codes == [0, 0], "\n----\n".join(o[-4000:] for o in outputs.values())
    # The final round's two ranks (one per node) agree on every parameter.
    finals = {}
    for out in outputs.values():
        for rank, digest in FINAL_RE.findall(out):
            finals[int(rank)] = digest
    assert sorted(finals) == [0, 1], outputs
    assert finals[0] == finals[1], finals
    assert re.search(r"^\[rank 0\] training complete: .*parameters identical on all 2 ranks",
                     outputs["node-b"], re.M), outputs["node-b"][-3000:]
    if script == "hvd_state.py":
        # Nothing of the three epochs (1438 samples each) was skipped.
        m = re.search(r"training complete: (\d+) samples", outputs["node-b"])
        assert m and 3 * 1438 <= int(m.group(1)) <= 3 * 1438 + 3 * 2, outputs["node-b"][-3000:]
