"""`efdl run` of a 2-node job against an etcd that serves TLS with --client-cert-auth and has
user/password auth on (certificates made by tests/etcd/secure_etcd_setup.sh at test time): the
job runs, both nodes' workers get the same EFDL_JOB_SECRET (the one in etcd), the secret and the
password never show in the output, and a wrong password is one clear error line. With one etcd
role per job (readwrite on /efdl/<job>/ only), each job runs on its own role, and one job's user
can neither read nor change another job's keys, its secret included."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

EFDL = cluster.efdl_bin()
SETUP = os.path.join(cluster.REPO, "tests", "etcd", "secure_etcd_setup.sh")
pytestmark = pytest.mark.skipif(EFDL is None, reason="efdl binary not built (set EFDL_BIN)")


def kill_group(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.fixture
def secure_etcd(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run([SETUP, "certs", str(certs)], check=True, timeout=60)
    client, peer = cluster.free_port(), cluster.free_port()
    endpoint = "127.0.0.1:%d" % client
    log = open(tmp_path / "etcd.log", "w")
    etcd = subprocess.Popen(
        cluster.etcd_argv("sec", str(tmp_path / "data"), endpoint, peer, scheme="https") +
        ["--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server-key.pem"),
         "--client-cert-auth", "--trusted-ca-file", str(certs / "ca.pem")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        ctl = ["etcdctl", "--endpoints", "https://" + endpoint, "--cacert", str(certs / "ca.pem"),
               "--cert", str(certs / "client.pem"), "--key", str(certs / "client-key.pem")]
        env = dict(os.environ, ETCDCTL_API="3")
        deadline = time.monotonic() + 30
        while subprocess.run(ctl + ["endpoint", "health"], env=env, capture_output=True,
                             timeout=30).returncode != 0:
            assert etcd.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not become healthy in 30 s"
            time.sleep(0.2)
        subprocess.run([SETUP, "auth", endpoint, str(certs)], check=True, timeout=60)
        password = tmp_path / "password"
        password.write_text("jobpw\n")
        password.chmod(0o600)
        yield {"endpoint": endpoint, "certs": certs, "password": password,
               "ctl": ctl + ["--user", "root:rootpw"], "env": env}
    finally:
        kill_group(etcd)


def security_flags(etcd, user, password_file):
    certs = etcd["certs"]
    return ["--etcd", etcd["endpoint"],
            "--etcd-cacert", str(certs / "ca.pem"), "--etcd-cert", str(certs / "client.pem"),
            "--etcd-key", str(certs / "client-key.pem"), "--etcd-user", user,
            "--etcd-password-file", str(password_file)]


def agent_argv(etcd, job, node, out_dir, password_file, user="job"):
    worker = ('echo "$EFDL_JOB_SECRET" > %s/secret.$EFDL_NODE_ID; '
              'echo "worker rank=$RANK world=$WORLD_SIZE"') % out_dir
    return ([EFDL, "run"] + security_flags(etcd, user, password_file) +
            ["--job", job, "--node-id", node, "--nnodes", "2", "--nproc-per-node", "1",
             "--ttl", "10", "--", "sh", "-c", worker])


def test_two_node_job_over_tls_with_auth_shares_the_job_secret(secure_etcd, tmp_path):
    secret, outputs = run_two_node_job(secure_etcd, "secjob", "job", secure_etcd["password"],
                                       tmp_path / "out", nodes=["n0", "n1"], timeout=90)
    stored = subprocess.run(secure_etcd["ctl"] + ["get", "--print-value-only",
                                                  "/efdl/secjob/secret"],
                            env=secure_etcd["env"], capture_output=True, text=True, timeout=30)
    assert stored.stdout.strip() == secret
    for text in outputs:
        assert secret not in text, "the job secret was logged"
        assert "jobpw" not in text, "the password was logged"


def test_wrong_password_is_one_clear_line(secure_etcd, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    wrong.chmod(0o600)
    proc = subprocess.run(agent_argv(secure_etcd, "secjob2", "n0", tmp_path, wrong),
                          env=cluster.base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "wrong user name or password" in lines[0], proc.stderr
    assert "not-the-password" not in proc.stderr + proc.stdout


# Job B's id starts with job A's: a grant on "/efdl/alpha" without the trailing slash would
# also cover "/efdl/alpha2/", and this test would catch it.
JOB_A, JOB_B = "alpha", "alpha2"


def password_file(tmp_path, job):
    path = tmp_path / ("pw-" + job)
    path.write_text("pw-%s\n" % job)
    path.chmod(0o600)
    return path


def run_two_node_job(etcd, job, user, password, out_dir, nodes=None, timeout=120):
    """Runs a 2-node job to completion, its agents' nodes `nodes` (by default <job>-n0 and
    <job>-n1) with their workers' files in `out_dir`; returns the secret both nodes' workers
    got and the agents' outputs."""
    nodes = nodes or ["%s-n%d" % (job, i) for i in range(2)]
    out_dir.mkdir()
    agents = [subprocess.Popen(agent_argv(etcd, job, node, out_dir, password, user=user),
                               env=cluster.base_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for node in nodes]
    try:
        outputs = [a.communicate(timeout=timeout)[0] for a in agents]
    finally:
        for a in agents:
            kill_group(a)
    for a, text in zip(agents, outputs):
        assert a.returncode == 0, "job %s as %s:\n%s" % (job, user, text[-3000:])
        assert "world=2" in text, text[-3000:]
    secrets = {(out_dir / ("secret." + node)).read_text().strip() for node in nodes}
    assert len(secrets) == 1, secrets
    secret = secrets.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    return secret, outputs


def test_per_job_roles_keep_each_jobs_keys_and_secret_apart(secure_etcd, tmp_path):
    endpoint, certs = secure_etcd["endpoint"], secure_etcd["certs"]
    subprocess.run([SETUP, "job-roles", endpoint, str(certs), JOB_A, JOB_B], check=True,
                   timeout=120)
    user = {job: "user-" + job for job in (JOB_A, JOB_B)}
    password = {job: password_file(tmp_path, job) for job in (JOB_A, JOB_B)}
    root_ctl, env = secure_etcd["ctl"], secure_etcd["env"]
    # etcdctl as each job's user (root_ctl ends with "--user", "root:rootpw").
    ctl_as = {job: root_ctl[:-1] + ["%s:pw-%s" % (user[job], job)] for job in (JOB_A, JOB_B)}

    def etcdctl(argv, *args):
        return subprocess.run(argv + list(args), env=env, capture_output=True, text=True,
                              timeout=30)

    # Each job runs to completion on its own role alone: the role covers every key a job uses,
    # its secret included.
    secret = {job: run_two_node_job(secure_etcd, job, user[job], password[job],
                                    tmp_path / ("out-" + job))[0]
              for job in (JOB_A, JOB_B)}
    assert secret[JOB_A] != secret[JOB_B]
    for job in (JOB_A, JOB_B):
        stored = etcdctl(root_ctl, "get", "--print-value-only", "/efdl/%s/secret" % job)
        assert stored.returncode == 0 and stored.stdout.strip() == secret[job], stored

    # A's user reads A's keys ...
    own = etcdctl(ctl_as[JOB_A], "get", "--print-value-only", "/efdl/%s/secret" % JOB_A)
    assert own.returncode == 0 and own.stdout.strip() == secret[JOB_A], own
    own_keys = etcdctl(ctl_as[JOB_A], "get", "--prefix", "--keys-only", "/efdl/%s/" % JOB_A)
    assert own_keys.returncode == 0, own_keys
    assert "/efdl/%s/round" % JOB_A in own_keys.stdout.split(), own_keys.stdout
    # ... and none of B's: not its secret nor any other key B wrote (root sees them), not the
    # list of all jobs, and it cannot overwrite B's secret.
    b_keys = etcdctl(root_ctl, "get", "--prefix", "--keys-only", "/efdl/%s/" % JOB_B)
    b_keys = [k for k in b_keys.stdout.split() if k]
    for key in ("secret", "round", "status", "complete"):
        assert "/efdl/%s/%s" % (JOB_B, key) in b_keys, b_keys
    denied = [("get", "/efdl/%s/secret" % JOB_B)] + [
        ("get", key) for key in b_keys if not key.endswith("/secret")] + [
        ("get", "--prefix", "/efdl/%s/" % JOB_B), ("get", "--prefix", "/efdl/"),
        ("put", "/efdl/%s/secret" % JOB_B, "0" * 64), ("del", "/efdl/%s/round" % JOB_B)]
    for args in denied:
        got = etcdctl(ctl_as[JOB_A], *args)
        assert got.returncode != 0 and "permission denied" in got.stderr, (args, got)
        assert secret[JOB_B] not in got.stdout + got.stderr, args
    # The other way round too, for the secret.
    got = etcdctl(ctl_as[JOB_B], "get", "/efdl/%s/secret" % JOB_A)
    assert got.returncode != 0 and "permission denied" in got.stderr, got
    stored = etcdctl(root_ctl, "get", "--print-value-only", "/efdl/%s/secret" % JOB_B)
    assert stored.stdout.strip() == secret[JOB_B], "user A changed job B's secret"

    # efdl with A's credentials (and a private shared-memory directory, for `efdl reset`).
    (tmp_path / "shm").mkdir()

    def efdl_as_a(*args):
        env = dict(cluster.base_env(), EFDL_SHM_DIR=str(tmp_path / "shm"))
        return subprocess.run([EFDL] + list(args) +
                              security_flags(secure_etcd, user[JOB_A], password[JOB_A]),
                              env=env, capture_output=True, text=True, timeout=60)

    # `efdl status`: A's job shows; B's is one clear error line, with nothing of B in it.
    mine = efdl_as_a("status", "--job", JOB_A)
    assert mine.returncode == 0 and "%s-n0" % JOB_A in mine.stdout, mine
    theirs = efdl_as_a("status", "--job", JOB_B)
    assert theirs.returncode == 1, theirs
    assert theirs.stdout == "", theirs.stdout
    lines = [line for line in theirs.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("efdl status: error:"), theirs.stderr
    assert "permission denied" in lines[0] and JOB_B in lines[0], lines[0]
    assert "%s-n" % JOB_B not in theirs.stderr and secret[JOB_B] not in theirs.stderr

    # `efdl reset` with A's credentials: refused on B (B's records stay), done on A (A's round
    # goes, its secret stays).
    snapshots = ["--snapshot-dir", str(tmp_path / "snapshots")]
    reset = efdl_as_a("reset", "--job", JOB_B, *snapshots)
    assert reset.returncode == 1 and "permission denied" in reset.stderr, reset
    for key in ("round", "secret"):
        kept = etcdctl(root_ctl, "get", "--keys-only", "/efdl/%s/%s" % (JOB_B, key))
        assert kept.stdout.strip() == "/efdl/%s/%s" % (JOB_B, key), (key, kept)
    reset = efdl_as_a("reset", "--job", JOB_A, *snapshots)
    assert reset.returncode == 0, reset
    gone = etcdctl(ctl_as[JOB_A], "get", "--keys-only", "--prefix", "/efdl/%s/" % JOB_A)
    assert gone.returncode == 0 and gone.stdout.split() == ["/efdl/%s/secret" % JOB_A], gone
