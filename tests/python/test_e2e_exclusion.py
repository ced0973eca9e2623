"""Nodes that keep failing are excluded for a cool-down (issue #32, part 4; docs/operations.md,
"Nodes that keep failing").

Three agents on one real etcd, real gloo workers (workers/allreduce_worker.py, a plain
torch.distributed program: the restart path). node-c's program raises after 3 steps in every
round (WORKER_FAIL_AFTER, given to node-c only: a bad host). With
--exclude-after 2 it is excluded after its second own failure; the job goes on at world 2;
`efdl status` shows the exclusion and when node-c may rejoin; after the cool-down node-c joins
again with fresh workers (and, failing again, is excluded again, for twice as long). The healthy
nodes see only collateral failures (their collective lost node-c): never counted, never
excluded. The job finishes with them, and node-c, excluded at that moment, learns it at once and
exits 0.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

COOLDOWN = 8


@pytest.fixture
def job():
    with cluster.running("excl-%d" % os.getpid()) as c:
        yield c


def status(c, *extra):
    proc = subprocess.run([cluster.efdl_bin(), "status", "--etcd", c.endpoint, "--job", c.job]
                          + list(extra), env=cluster.base_env(), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def wait_line(agent, pattern, timeout, others=()):
    """Waits until `agent` logged `pattern`; returns the time it was seen."""
    cluster.wait_for_log(agent, pattern, timeout, (agent,) + tuple(others))
    return time.monotonic()


def test_a_node_that_keeps_failing_is_excluded_the_job_goes_on_and_it_rejoins(job):
    started = time.monotonic()
    # 300 steps of 0.05 s: node-c's second exclusion comes after about 8 s of them (the
    # cool-down at world 2), and the job must still run then.
    env = {"WORKER_STEPS": "300", "WORKER_STEP_TIME": "0.05",
           "WORKER_PROGRESS": os.path.join(job.dir, "progress")}
    extra = ["--no-prestart", "--exclude-after", "2", "--exclude-window", "60",
             "--exclude-cooldown", str(COOLDOWN)]
    command = [cluster.PYTHON, cluster.WORKER]
    a = job.start_agent("node-a", env=env, nnodes="2:3", extra=extra, command=command)
    b = job.start_agent("node-b", env=env, nnodes="2:3", extra=extra, command=command)
    c = job.start_agent("node-c", env=dict(env, WORKER_FAIL_AFTER="3"), nnodes="2:3",
                        extra=extra, command=command)
    agents = (a, b, c)

    # node-c's own failures exclude it after the second; it says until when.
    excluded_at = wait_line(c, r"node node-c is excluded from job '%s' for %d s \(exclusion 1\)"
                            % (job.job, COOLDOWN), 60, others=(a, b))
    line = next(l for l in c.own_output().splitlines() if "is excluded from job" in l)
    assert "exited with status 1" in line, line
    assert "2 of this node's own worker failures within 60 s (--exclude-after 2)" in line, line
    assert re.search(r"it rejoins with fresh workers at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", line), line

    # `efdl status` shows it with the reason and when it may rejoin (text and JSON).
    text = status(job)
    assert re.search(r"node-c EXCLUDED at \S+ until \S+Z \(its own workers failed 2 time\(s\); "
                     r"exclusion 1\); it may rejoin then: .*exited with status 1", text), text
    assert "RuntimeError: this host is bad" in text, text
    data = json.loads(status(job, "--json"))
    rec = data["excluded"]["node-c"]
    assert rec["failures"] == 2 and rec["exclusion"] == 1, rec
    assert rec["until"] > rec["time"], rec
    assert any("this host is bad" in l for l in rec["stderr"]), rec
    assert not data["gave_up"], data

    # The job goes on without it, at world 2, within the cool-down.
    job.wait_for_world(2, since=excluded_at, agents=[a, b], timeout=COOLDOWN + 20)
    data = json.loads(status(job, "--json"))
    ids = {m["id"] for m in data["members"] + data["standbys"] + data["waiting"]}
    assert "node-c" not in ids, data
    # Collateral failures (their collective lost node-c) are never the healthy nodes' own.
    for m in data["members"]:
        assert m["restarts"] == 0, data

    # After the cool-down node-c registers again, its record goes, and it starts fresh workers
    # in a round of world 3 (where its program fails again).
    back_at = wait_line(c, r"node node-c is back in job '%s' after its cool-down" % job.job,
                        COOLDOWN + 30, others=(a, b))
    assert back_at - excluded_at >= COOLDOWN - 0.5, back_at - excluded_at
    assert "cool-down over: registered in job %s again" % job.job in c.own_output()
    assert "node-c" not in json.loads(status(job, "--json"))["excluded"], c.own_output()
    job.wait_for_world(3, since=back_at, timeout=40, full=False)

    # Failing again, it is excluded again, for twice as long.
    wait_line(c, r"is excluded from job '%s' for %d s \(exclusion 2\)" % (job.job, 2 * COOLDOWN),
              60, others=(a, b))

    # The healthy nodes finish the job; node-c, excluded meanwhile, learns it within seconds
    # (not at the end of its cool-down) and exits 0.
    codes = [a.wait(90 - (time.monotonic() - started)), b.wait(30)]
    done_at = time.monotonic()
    assert codes == [0, 0], (codes, a.own_output()[-3000:], b.own_output()[-3000:])
    code_c = c.wait(2 * COOLDOWN)
    assert code_c == 0, (code_c, c.own_output()[-3000:])
    assert time.monotonic() - done_at < 8, c.own_output()[-2000:]
    assert "job '%s' is complete" % job.job in c.own_output(), c.own_output()[-2000:]
    for x in (a, b):
        out = x.own_output()
        assert "is excluded" not in out, out
        assert "giving up" not in out, out
        assert not re.search(r"restart \d+ ", out), out
    assert "giving up" not in c.own_output(), c.own_output()
    assert time.monotonic() - started < 90, time.monotonic() - started
