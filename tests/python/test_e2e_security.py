"""`efdl run` of a 2-node job against an etcd that serves TLS with --client-cert-auth and has
user/password auth on (certificates made by tests/etcd/secure_etcd_setup.sh at test time): the
job runs, both nodes' workers get the same EFDL_JOB_SECRET (the one in etcd), the secret and the
password never show in the output, and a wrong password is one clear error line."""

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
        ["etcd", "--name", "sec", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", "https://" + endpoint,
         "--advertise-client-urls", "https://" + endpoint,
         "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
         "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
         "--initial-cluster", "sec=http://127.0.0.1:%d" % peer,
         "--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server-key.pem"),
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


def agent_argv(etcd, job, node, out_dir, password_file):
    certs = etcd["certs"]
    worker = ('echo "$EFDL_JOB_SECRET" > %s/secret.$EFDL_NODE_ID; '
              'echo "worker rank=$RANK world=$WORLD_SIZE"') % out_dir
    return [EFDL, "run", "--etcd", etcd["endpoint"], "--job", job, "--node-id", node,
            "--nnodes", "2", "--nproc-per-node", "1", "--ttl", "10",
            "--etcd-cacert", str(certs / "ca.pem"), "--etcd-cert", str(certs / "client.pem"),
            "--etcd-key", str(certs / "client-key.pem"), "--etcd-user", "job",
            "--etcd-password-file", str(password_file), "--", "sh", "-c", worker]


def test_two_node_job_over_tls_with_auth_shares_the_job_secret(secure_etcd, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agents = [subprocess.Popen(agent_argv(secure_etcd, "secjob", "n%d" % i, out,
                                          secure_etcd["password"]),
                               env=cluster.base_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for i in range(2)]
    try:
        outputs = [a.communicate(timeout=90)[0] for a in agents]
    finally:
        for a in agents:
            kill_group(a)
    for a, text in zip(agents, outputs):
        assert a.returncode == 0, text[-3000:]
        assert "world=2" in text, text[-3000:]
    secrets = {(out / ("secret.n%d" % i)).read_text().strip() for i in range(2)}
    assert len(secrets) == 1, secrets
    secret = secrets.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
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
