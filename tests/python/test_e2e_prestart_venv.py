"""Pre-started workers for a worker interpreter that cannot import efdl by itself (issue #39):
a torchrun program run from its own virtual environment, with no PYTHONPATH to the package.

The agent gives the package's directory to the zygote alone, so rounds still take pre-started
workers, and the program's sys.path and environment stay those its interpreter gives it. An
interpreter of another Python version cannot load the package's compiled part: the agent says
so once, with the cost and the fix, starts no spares, and `efdl status` shows the node runs
without them.

Real etcd, real agents, real gloo workers (workers/allreduce_worker.py). Bounded in time; every
process started is killed by the fixture (by pid / process group).
"""

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402
from cluster import wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")

PACKAGE_DIR = os.path.join(cluster.REPO, "python")


@pytest.fixture
def job():
    with cluster.running("prestart-venv-%d" % os.getpid()) as c:
        yield c


def env_without_pythonpath(job):
    env = cluster.base_env()
    del env["PYTHONPATH"]
    env["TMPDIR"] = job.tmp_dir
    return env


def start_agent(job, node_id, command, env, **kwargs):
    """cluster.Cluster.start_agent, but with exactly `env` (no PYTHONPATH added)."""
    agent = cluster.Agent(node_id, job.agent_argv(node_id, command=command, **kwargs), env)
    job.agents.append(agent)
    return agent


def imports_efdl(python, env):
    proc = subprocess.run([python, "-c", "import efdl"], env=env, cwd="/", capture_output=True,
                          text=True, timeout=60)
    return proc.returncode == 0


def make_venv_without_efdl(venv, env):
    """A virtual environment of cluster.PYTHON that sees its torch but not efdl: made with
    --system-site-packages, as a user would; where `make install` put efdl into those
    site-packages, without them and with a .pth to torch's directory instead. Returns its
    interpreter."""
    python = str(venv / "bin" / "python3")
    subprocess.run([cluster.PYTHON, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    if not imports_efdl(python, env):
        return python
    torch_dir = subprocess.run([cluster.PYTHON, "-c", "import os, torch; print(os.path.dirname("
                                "os.path.dirname(torch.__file__)))"], env=env, cwd="/",
                               capture_output=True, text=True, timeout=60).stdout.strip()
    assert not os.path.exists(os.path.join(torch_dir, "efdl")), torch_dir
    with open(venv / "pyvenv.cfg") as f:
        cfg = f.read().replace("include-system-site-packages = true",
                               "include-system-site-packages = false")
    with open(venv / "pyvenv.cfg", "w") as f:
        f.write(cfg)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], env=env, cwd="/", capture_output=True, text=True,
                          timeout=60).stdout.strip()
    with open(os.path.join(site, "torch-dir.pth"), "w") as f:
        f.write(torch_dir + "\n")
    assert not imports_efdl(python, env)
    return python


# Prints what the program sees of its own path, then runs the ordinary allreduce worker.
PATH_WORKER = """import json, os, runpy, sys
print("PATHCHECK " + json.dumps({"path": sys.path, "pythonpath": os.environ.get("PYTHONPATH"),
      "preload_path": os.environ.get("EFDL_PRELOAD_PATH")}), flush=True)
runpy.run_path(%r, run_name="__main__")
""" % cluster.WORKER


def test_a_venv_without_efdl_gets_prestarted_workers_and_keeps_its_own_path(job, tmp_path):
    env = env_without_pythonpath(job)
    python = make_venv_without_efdl(tmp_path / "venv", env)
    worker = tmp_path / "path_worker.py"
    worker.write_text(PATH_WORKER)
    # What the program's own interpreter gives a script in tmp_path.
    fresh = subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                           env=env, cwd="/", capture_output=True, text=True, timeout=60)
    own_path = [os.path.realpath(tmp_path)] + json.loads(fresh.stdout)

    command = [python, str(worker)]
    a = start_agent(job, "a", command, env, nnodes="1:2")
    job.wait_for_world(1, timeout=90)
    wait_for(lambda: len(a.worker_pids()) == 2, 60, "agent a's worker and its new spare")
    b = start_agent(job, "b", command, env, nnodes="1:2")
    job.wait_for_world(2, since=time.monotonic(), timeout=120)

    for agent in (a, b):
        out = agent.output()
        assert ("cannot import efdl by itself; its zygote is given the package in %s"
                % PACKAGE_DIR) in out, out[-3000:]
        assert "no pre-started workers" not in out and "exited before its imports" not in out, \
            out[-3000:]
        # The round change that grew the world ran on pre-started workers on both nodes.
        taken = [line for line in out.splitlines() if "taken from pre-started spares" in line]
        assert taken and "1 of 1 worker(s) taken" in taken[-1], out[-3000:]
        seen = [json.loads(line.split("PATHCHECK ", 1)[1]) for line in out.splitlines()
                if "PATHCHECK " in line]
        assert seen, out[-3000:]
        for s in seen:
            assert s == {"path": own_path, "pythonpath": None, "preload_path": None}, (s, own_path)
    assert len(re.findall(r"round \d+: 1 of 1 worker\(s\) taken", a.output())) >= 2, \
        a.output()[-3000:]


def other_python():
    """A real interpreter of another Python version than cluster.PYTHON's, or None."""
    def version(python):
        try:
            proc = subprocess.run([python, "-c", "import sys; print('%d.%d %s' % ("
                                   "sys.version_info[:2] + (sys.executable,)))"],
                                  capture_output=True, text=True, timeout=30)
        except OSError:
            return None
        return proc.stdout.split() if proc.returncode == 0 else None

    ours = version(cluster.PYTHON)[0]
    candidates = sorted(glob.glob("/usr/bin/python3.*") + glob.glob("/usr/local/bin/python3.*")
                        + glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python3.*")))
    for path in candidates:
        if not re.fullmatch(r"python3\.\d+", os.path.basename(path)):
            continue
        v = version(path)
        if v and v[0] != ours and tuple(map(int, v[0].split("."))) >= (3, 6):
            return v[1], v[0]
    return None


# No torch in that interpreter: a program that prints step lines without it.
PLAIN_WORKER = """import os, sys, time
for step in range(100000):
    print("STEP round=%s rank=%s world=%s step=%d" % (os.environ["EFDL_ROUND"],
          os.environ["RANK"], os.environ["WORLD_SIZE"], step), flush=True)
    time.sleep(0.1)
"""


def test_another_python_version_warns_once_and_status_shows_no_prestarted_workers(job,
                                                                                  tmp_path):
    found = other_python()
    if found is None:
        pytest.skip("no interpreter of another Python version than %s on this machine "
                    "(the decision itself: spare_pool_test ChoosePackageDir)" % cluster.PYTHON)
    python, version = found
    env = env_without_pythonpath(job)
    assert not imports_efdl(python, env)
    worker = tmp_path / "plain_worker.py"
    worker.write_text(PLAIN_WORKER)
    a = start_agent(job, "a", [python, str(worker)], env, nnodes="1:1")
    job.wait_for_world(1, timeout=90)
    out = a.output()
    warnings = [line for line in out.splitlines() if " W efdl: no pre-started workers" in line]
    assert len(warnings) == 1, out[-3000:]
    for part in ("%s (Python %s) cannot import efdl" % (python, version), "4-5x slower",
                 "fix: run the workers with Python 3.",
                 "`%s %s/scripts/install-python-package.py %s`" % (python, cluster.REPO,
                                                                  PACKAGE_DIR)):
        assert part in warnings[0], (part, warnings[0])
    assert "0 of 1 worker(s) taken from pre-started spares" in out, out[-3000:]
    assert not a.zygote_pids(), out[-3000:]

    def status(*extra):
        return subprocess.run([cluster.efdl_bin(), "status", "--etcd", job.endpoint, "--job",
                               job.job] + list(extra), env=cluster.base_env(),
                              capture_output=True, text=True, timeout=60)

    text = status()
    assert text.returncode == 0, text.stderr
    line = [ln for ln in text.stdout.splitlines() if "WITHOUT PRE-STARTED WORKERS" in ln]
    assert len(line) == 1 and line[0].strip().startswith("a runs WITHOUT PRE-STARTED WORKERS"), \
        text.stdout
    assert "(Python %s) cannot import efdl" % version in line[0], text.stdout
    js = status("--json")
    assert js.returncode == 0, js.stderr
    member = json.loads(js.stdout)["members"][0]
    assert member["id"] == "a" and "cannot import efdl" in member["no_prestart"], member
