"""Bad input from outside the agent (issue #9, "bad input fuzzing"): every flag and EFDL_*
variable of the CLI with bad values, and values written under a running job's etcd prefix by
something other than an agent. Each gets a clear error; nothing crashes.

The parsers themselves are also fuzzed (fuzz/, `make sanitize`)."""

import os
import signal
import subprocess
import sys

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
    (["snapshots", "list"], {}, "--job"),
    (["snapshots", "list", "--job", "j", "--seq", "x"], {}, "--seq"),
    (["nosuchcommand"], {}, "subcommand"),
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
