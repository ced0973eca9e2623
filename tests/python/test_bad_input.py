"""Bad input from outside the agent (issue #9, "bad input fuzzing"): every flag and EFDL_*
variable of the CLI with bad values, and values written under a running job's etcd prefix by
something other than an agent. Each gets a clear error; nothing crashes.

The parsers themselves are also fuzzed (fuzz/, `make sanitize`)."""

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

# (subcommand and arguments, extra environment, text the one error line must contain).
# `run` cases end in `-- true`: if a bad value were accepted, the job would run and exit 0.
RUN = ["run", "--job", "j"]
CASES = [
    (RUN + ["--nnodes", "abc", "--", "true"], {}, "--nnodes"),
    (RUN + ["--nnodes", "3:1", "--", "true"], {}, "MIN 3 is greater than MAX 1"),
    (RUN + ["--nnodes", "0", "--", "true"], {}, "--nnodes"),
    (RUN + ["--nnodes", "-1", "--", "true"], {}, "--nnodes"),
    (RUN + ["--nnodes", "1:99999999999999999999", "--", "true"], {}, "--nnodes"),
    (RUN + ["--nproc-per-node", "-1", "--", "true"], {}, "--nproc-per-node"),
    (RUN + ["--nproc-per-node", "abc", "--", "true"], {}, "--nproc-per-node"),
    (RUN + ["--nproc-per-node", "1e9", "--", "true"], {}, "--nproc-per-node"),
    (RUN + ["--nproc-per-node", "100000", "--", "true"], {}, "--nproc-per-node"),
    (RUN + ["--nproc-per-node", "99999999999", "--", "true"], {}, "--nproc-per-node"),
    (RUN + ["--ttl", "abc", "--", "true"], {}, "--ttl"),
    (RUN + ["--ttl", "-5", "--", "true"], {}, "--ttl"),
    (RUN + ["--ttl", "0.5", "--", "true"], {}, "--ttl"),
    (RUN + ["--ttl", "nan", "--", "true"], {}, "--ttl"),
    (RUN + ["--ttl", "inf", "--", "true"], {}, "--ttl"),
    (RUN + ["--ttl", "1e300", "--", "true"], {}, "--ttl"),
    (RUN + ["--last-call", "-1", "--", "true"], {}, "--last-call"),
    (RUN + ["--last-call", "nan", "--", "true"], {}, "--last-call"),
    (RUN + ["--last-call", "1e300", "--", "true"], {}, "--last-call"),
    (RUN + ["--join-timeout", "0", "--", "true"], {}, "--join-timeout"),
    (RUN + ["--join-timeout", "inf", "--", "true"], {}, "--join-timeout"),
    (RUN + ["--join-timeout", "x", "--", "true"], {}, "--join-timeout"),
    (RUN + ["--max-restarts", "-3", "--", "true"], {}, "--max-restarts"),
    (RUN + ["--max-restarts", "1.5", "--", "true"], {}, "--max-restarts"),
    (RUN + ["--exclude-after", "-1", "--", "true"], {}, "--exclude-after -1 is negative"),
    (RUN + ["--exclude-window", "0", "--", "true"], {}, "--exclude-window"),
    (RUN + ["--exclude-cooldown", "inf", "--", "true"], {}, "--exclude-cooldown"),
    (RUN + ["--", "true"], {"EFDL_EXCLUDE_AFTER": "x"}, "--exclude-after"),
    (RUN + ["--stop-grace", "-1", "--", "true"], {}, "--stop-grace"),
    (RUN + ["--stop-grace", "1e300", "--", "true"], {}, "--stop-grace"),
    (["run", "--job", "a/b", "--", "true"], {}, "job id 'a/b'"),
    (["run", "--job", "x" * 200, "--", "true"], {}, "job id"),
    (RUN + ["--node-id", "bad id", "--", "true"], {}, "node id 'bad id'"),
    (RUN + ["--node-id", "../x", "--", "true"], {}, "node id '../x'"),
    (RUN + ["--etcd", "127.0.0.1:99999", "--", "true"], {}, "--etcd"),
    (RUN + ["--etcd", ",,,", "--", "true"], {}, "--etcd"),
    (RUN + ["--etcd", "host:", "--", "true"], {}, "--etcd"),
    (RUN + ["--frobnicate", "--", "true"], {}, "--frobnicate"),
    (RUN + ["--", "efdl-no-such-program"], {}, "efdl-no-such-program"),
    (RUN, {}, "command"),
    # The same through the environment.
    (RUN + ["--", "true"], {"EFDL_NNODES": "abc"}, "--nnodes"),
    (RUN + ["--", "true"], {"EFDL_NPROC_PER_NODE": "-1"}, "--nproc-per-node"),
    (RUN + ["--", "true"], {"EFDL_NPROC_PER_NODE": "many"}, "--nproc-per-node"),
    (RUN + ["--", "true"], {"EFDL_TTL": "abc"}, "--ttl"),
    (RUN + ["--", "true"], {"EFDL_TTL": "-1"}, "--ttl"),
    (RUN + ["--", "true"], {"EFDL_LAST_CALL": "nan"}, "--last-call"),
    (RUN + ["--", "true"], {"EFDL_JOIN_TIMEOUT": "0"}, "--join-timeout"),
    (RUN + ["--", "true"], {"EFDL_MAX_RESTARTS": "-1"}, "--max-restarts"),
    (RUN + ["--", "true"], {"EFDL_STOP_GRACE": "x"}, "--stop-grace"),
    (RUN + ["--", "true"], {"EFDL_NODE_ID": "a b"}, "node id"),
    (RUN + ["--", "true"], {"EFDL_ETCD_ENDPOINTS": "h:0x50"}, "--etcd"),
    (["run", "--", "true"], {"EFDL_JOB_ID": "a/b"}, "job id"),
    # The other subcommands.
    (["status"], {}, "--job"),
    (["status", "--job", "a/b", "--etcd", "127.0.0.1:1"], {}, "job id"),
    (["status", "--job", "j", "--etcd", "127.0.0.1:99999"], {}, "--etcd"),
    (["plan", "--procs", "abc", "--free", "h:1"], {}, "--procs"),
    (["plan", "--procs", "0", "--free", "h:1"], {}, "--procs"),
    (["plan", "--procs", "2", "--free", "garbage"], {}, "garbage"),
    (["plan", "--procs", "2", "--free", "h:1", "--max-parts", "-1"], {}, "--max-parts"),
    (["sim", "--nodes", "abc"], {}, "--nodes"),
    (["sim", "--nodes", "10", "--ttl", "-1"], {}, "--ttl"),
    (["sim", "--nodes", "10", "--seed", "-1"], {}, "--seed"),
    (["etcd", "--port", "99999"], {}, "--port"),
    (["etcd", "--port", "-1"], {}, "--port"),
    (["snapshots", "show"], {}, "--job"),   # `list` without --job lists this host's arenas
    (["snapshots", "list", "--job", "j", "--seq", "x"], {}, "--seq"),
    (["nosuchcommand"], {}, "unknown command 'nosuchcommand'"),
]


def run_bounded(argv, extra_env, timeout=30):
    """Runs efdl in its own process group; on timeout kills that group and fails."""
    env = cluster.base_env()
    env.update(extra_env)
    proc = subprocess.Popen([EFDL] + argv, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("efdl %s %s still running after %s s" % (argv, extra_env, timeout))
    return proc.returncode, out, err


@pytest.mark.parametrize("argv, extra_env, expected", CASES,
                         ids=["%d-%s" % (i, " ".join(c[0][:4]) + str(c[1]))
                              for i, c in enumerate(CASES)])
def test_bad_argument_or_environment_is_one_line_and_exit_2(argv, extra_env, expected):
    code, out, err = run_bounded(argv, extra_env)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert expected in lines[0], err
    for crash in ("terminate called", "Aborted", "Segmentation", "AddressSanitizer",
                  "runtime error"):
        assert crash not in err, err


@pytest.fixture
def job():
    with cluster.running("badinput-%d" % os.getpid()) as c:
        yield c


def etcd_put(job, key, value):
    import etcd3
    host, port = job.endpoint.split(":")
    client = etcd3.client(host=host, port=int(port))
    try:
        client.put(key, value)
    finally:
        client.close()


def efdl_status(job):
    code, out, err = run_bounded(["status", "--etcd", job.endpoint, "--job", job.job, "--json"],
                                 {})
    assert code == 0, err
    return json.loads(out)


def test_foreign_values_under_the_job_prefix_are_logged_and_ignored(job):
    a = job.start_agent("node-a", nnodes="2:2")
    b = job.start_agent("node-b", nnodes="2:2")
    job.wait_for_world(2, timeout=90)

    p = "/efdl/%s/" % job.job
    written_at = time.monotonic()
    garbage = [
        (p + "nodes/intruder-1", "not json"),
        (p + "nodes/intruder-2", json.dumps({"addr": 5, "nproc": "four"})),
        (p + "nodes/intruder-3", json.dumps({"addr": "h", "nproc": 1 << 40})),
        (p + "ack/intruder-1", "{" * 100000),
        (p + "ack/intruder-2", json.dumps({"r": "1", "st": "ack", "port": 70000})),
        (p + "ack/intruder-3", "x" * (1 << 20)),
        (p + "assign/node-b", json.dumps({"r": [], "rank": "zero"})),
        (p + "status", json.dumps({"members": [{"id": 5, "rank": "x"}, 7],
                                   "standbys": {"a": 1}, "events": "none"})),
    ]
    for key, value in garbage:
        etcd_put(job, key, value)

    # Both agents keep training in the same round, and the coordinator said what it ignored.
    cluster.wait_for(lambda: all("ignoring a bad %s record" % kind in a.output() + b.output()
                                 for kind in ("node", "ack", "assignment")), 60,
                     "both agents to ignore the bad node, ack and assignment records",
                     output=lambda: (a.output() + b.output())[-4000:], interval=0.1)
    job.wait_for_world(2, since=time.monotonic(), timeout=60)
    assert a.proc.poll() is None and b.proc.poll() is None
    logs = a.output() + b.output()
    for line in logs.splitlines():
        assert len(line) < 2000, "a log line quotes a huge value: %s..." % line[:200]
    assert not any(s[0] >= written_at and s[3] != 2 for ag in (a, b) for s in ag.steps()), \
        "the world changed after the garbage was written"

    # `efdl status` reads a damaged status record without failing.
    st = efdl_status(job)
    assert st["exists"] and st["world_size"] == 2, st

    # A damaged round record: the agents log it and keep their workers running.
    etcd_put(job, p + "round", json.dumps({"r": "seven", "ph": 3, "d": [1, 2]}))
    cluster.wait_for(lambda: "ignoring a bad round record" in a.output() + b.output(), 30,
                     "an agent to ignore the bad round record",
                     output=lambda: (a.output() + b.output())[-4000:], interval=0.1)
    job.wait_for_world(2, since=time.monotonic(), timeout=60)
    assert a.proc.poll() is None and b.proc.poll() is None
    code, out, err = run_bounded(["status", "--etcd", job.endpoint, "--job", job.job], {})
    assert code != 0 and "round record" in err and len(err.strip().splitlines()) == 1, err
