"""End-to-end runs of examples/ so they never rot: the demo (quick), its Ctrl-C cleanup, and each
training example once, short.

Every process is started in its own session and killed by process group if a test overruns; a
test also checks that nothing naming its job is left running afterwards.
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
from cluster import PYTHON, REPO, alive  # noqa: E402
import cluster  # noqa: E402

EXAMPLES = os.path.join(REPO, "examples")
EFDL = cluster.efdl_bin() or os.path.join(REPO, "build", "efdl")

pytestmark = pytest.mark.skipif(not os.access(EFDL, os.X_OK),
                                reason="efdl binary not built (set EFDL_BIN)")


def env(**extra):
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("EFDL_", "TORCHELASTIC_")) and k not in (
             "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    e.update(PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1", EFDL_BIN=EFDL)
    e.update(extra)
    return e


def run(argv, timeout, cwd=REPO, **extra):
    """Runs argv in its own session; kills the whole group if it overruns. Returns (rc, output)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError("%s ran over %d s; output:\n%s" % (argv, timeout, out[-6000:]))
    return proc.returncode, out


def comm(pid):
    """The process name of `pid` ("" when gone)."""
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def processes_naming(text):
    """Pids of live processes whose command line contains `text` (read-only scan of /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open("/proc/%s/stat" % entry) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append((int(entry), cmd))
    return found


def parent(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def demo_leftovers():
    """What a demo may leave in this machine's temporary directories: its own directories, those
    of its agents (efdl-agent-*, which a SIGKILLed agent does not remove) and private etcds'
    data directories (efdl-etcd-*, #38)."""
    names = []
    for d in ("/tmp", "/dev/shm"):
        names += [os.path.join(d, n) for n in os.listdir(d)
                  if n.startswith(("efdl-demo-", "efdl-agent-", "efdl-etcd-"))]
    return set(names)


def test_demo_quick_survives_crash_join_and_leave_and_cleans_up(tmp_path):
    out_dir = tmp_path / "out"
    before = demo_leftovers()
    started = time.monotonic()
    rc, out = run([PYTHON, os.path.join(EXAMPLES, "demo.py"), "--quick", "--out", str(out_dir)],
                  timeout=240)
    elapsed = time.monotonic() - started
    assert rc == 0, out[-6000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    print(out[-3000:])
    print("demo --quick took %.1f s" % elapsed)

    events = summary["events"]
    assert [e["kind"] for e in events] == ["crash", "join", "leave"], events
    assert [(e["world_before"], e["world_after"]) for e in events] == [(3, 2), (2, 3), (3, 2)]
    crash, join, leave = events
    # A crash loses at most the steps since the last commit; graceful changes lose nothing.
    assert crash["steps_lost"] <= summary["commit_interval"], crash
    assert join["samples_lost"] == 0 and leave["samples_lost"] == 0, events
    for e in events:
        assert 0 < e["pause_s"] < 120, e
    # The program runs under efdl.elastic.run: at each event the two nodes that stay keep their
    # workers' processes (the crash's, the join's and the leave's survivors).
    assert [e["kept"] for e in events] == [2, 2, 2], events
    # Every epoch of the digits training set (1438 samples): nothing skipped; padding of the
    # last batch at world 3 may add a sample per rank and epoch.
    epochs = summary["epochs"]
    assert epochs * 1438 <= summary["final_samples"] <= epochs * 1438 + epochs * 3, summary
    assert summary["reference_samples"] == epochs * 1438
    # Both runs learned something (10 classes: chance is 0.1) and end up in the same league.
    assert summary["final_accuracy"] > 0.6 and summary["reference_accuracy"] > 0.6, summary
    assert abs(summary["final_accuracy"] - summary["reference_accuracy"]) < 0.25, summary
    assert summary["exit_codes"] == {"node-a": 128 + signal.SIGTERM, "node-b": 0, "node-d": 0}

    assert (out_dir / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"^crash\s+node-c\s", out, re.M), out[-3000:]
    assert "plot: " in out
    # The summary is the product's ledger (efdl events): the same events, their phases adding
    # up to each pause, and the goodput printed.
    ledger = summary["ledger"]
    assert [e["kind"] for e in ledger["events"]] == ["crash", "join", "leave"], ledger
    for e in ledger["events"]:
        assert abs(e["detection_s"] + e["waiting_s"] + e["rendezvous_s"] + e["restore_s"] +
                   e["first_step_s"] - e["pause_s"]) < 1e-6
    assert ledger["events"][0]["steps_lost"] <= summary["commit_interval"], ledger
    assert [e["steps_lost"] for e in ledger["events"][1:]] == [0, 0], ledger
    assert 0 < ledger["goodput"] < 1, ledger
    assert re.search(r"^goodput \d+\.\d% of ", out, re.M), out[-3000:]
    assert re.search(r"live page of the job: http://127\.0\.0\.1:\d+/", out), out[-6000:]
    assert not processes_naming(summary["job"])
    # Hang detection is on by default (issue #32): never fired in the demo's agents.
    for log in (out_dir / "logs").glob("*.log"):
        assert "made no progress" not in log.read_text(errors="replace"), log
    # Its directories, and those of its agents (the crashed node's included), are gone.
    assert not demo_leftovers() - before, demo_leftovers() - before


def test_demo_interrupted_with_ctrl_c_stops_every_process(tmp_path):
    proc = subprocess.Popen([PYTHON, os.path.join(EXAMPLES, "demo.py"), "--quick", "--out",
                             str(tmp_path / "out")], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        lines = []
        job = None
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"job (demo-\S+?),", line)
            job = job or (m and m.group(1))
            if "started 3 agents" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert job, "".join(lines)
        # Interrupt once the first round trains: agents, workers and etcd all run then.
        for line in proc.stdout:
            lines.append(line)
            if "== round 1 started" in line:
                break
            assert time.monotonic() < deadline + 90, "".join(lines)
        # Each agent forks a group reaper (efdl-reaper) that keeps the agent's command line,
        # starts a zygote (efdl-zygote) its spares are forked from, and runs its agent store
        # (efdl-store, torch's TCPStore server) in one of those spares.
        # (the demo's dashboard names the job too: it is neither an agent nor a reaper)
        named = [pid for pid, cmd in processes_naming(job) if " dashboard " not in cmd]
        reapers = [pid for pid in named if comm(pid) == "efdl-reaper"]
        agents = [pid for pid in named if pid not in reapers]
        children = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                    if parent(pid) in agents and pid not in reapers]
        zygotes = [pid for pid in children if comm(pid) == "efdl-zygote"]
        stores = [pid for pid in children if comm(pid) == "efdl-store"]
        workers = [pid for pid in children if pid not in zygotes + stores]
        # Each agent's worker, and its pre-started spare once refilled (the demo uses --prestart).
        assert len(agents) == 3 and 3 <= len(workers) <= 6, (agents, workers, "".join(lines))
        assert len(zygotes) == 3 and {parent(pid) for pid in zygotes} == set(agents), zygotes
        assert len(stores) == 3 and {parent(pid) for pid in stores} == set(agents), stores
        assert len(reapers) == 3 and {parent(pid) for pid in reapers} == set(agents), reapers
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, "".join(lines) + rest
        assert "interrupted" in rest
        # The reapers end right after their agents (a few ms: they kill what is left first).
        gone_by = time.monotonic() + 10
        while processes_naming(job) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not processes_naming(job), processes_naming(job)
        # The demo SIGKILLs whole nodes (each agent's group and its children's groups, the
        # zygote's and the store's too) and waits for the agents only: a worker (torch loaded) may take a moment
        # to finish dying. So this checks the demo's own cleanup; that a zygote ends with its
        # agent by itself is checked in tests/faults (SIGKILL of an agent alone).
        children = workers + zygotes + stores
        cluster.poll_until(lambda: not [pid for pid in children if alive(pid)], 15)
        assert not [pid for pid in children if alive(pid)], (workers, zygotes, stores)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("script", ["train_ddp_state.py", "train_elastic_run.py",
                                    "train_ddp_native.py", "hvd_elastic.py"])
def test_example_trains_under_a_one_node_efdl_run(tmp_path, script):
    (tmp_path / "shm").mkdir()
    rc, out = run([EFDL, "run", "--snapshot-dir", str(tmp_path / "snap"), "--job",
                   "ex-%d" % os.getpid(), "--", PYTHON, os.path.join(EXAMPLES, script),
                   "--epochs", "1"], timeout=90, cwd=str(tmp_path),
                  EFDL_SHM_DIR=str(tmp_path / "shm"))
    assert rc == 0, out[-4000:]
    # Hang detection is on by default (issue #32): it must never fire on the examples.
    assert "made no progress" not in out, out[-4000:]
    if script in ("train_ddp_state.py", "train_elastic_run.py"):
        assert re.search(r"^\[rank 0\] training complete: 1438 samples, test accuracy", out,
                         re.M), out[-4000:]
    elif script == "hvd_elastic.py":
        assert re.search(r"^\[rank 0\] training complete: test accuracy", out, re.M), out[-4000:]
    else:
        assert re.search(r"^\[rank 0\] epoch 0 loss [\d.]+ test accuracy", out, re.M), out[-4000:]
        assert list((tmp_path / "snap").rglob("last.pt")), out[-4000:]


def test_plain_train_ddp_state_restores_at_start_and_continues(tmp_path):
    # Private snapshot and shm dirs: the State also finds node-local copies in EFDL_SHM_DIR.
    (tmp_path / "shm").mkdir()
    extra = {"EFDL_SNAPSHOT_DIR": str(tmp_path / "snap"), "EFDL_SHM_DIR": str(tmp_path / "shm"),
             "EFDL_JOB_ID": "plain-restore-%d" % os.getpid()}
    argv = [PYTHON, os.path.join(EXAMPLES, "train_ddp_state.py"), "--log-interval", "1000"]
    rc, first = run(argv + ["--epochs", "1"], timeout=120, cwd=str(tmp_path), **extra)
    assert rc == 0, first
    assert "resuming at epoch 0, sample 0 of the epoch, 0 samples in all" in first, first
    assert "training complete: 1438 samples" in first, first
    # The second run finds the first one's snapshot: epoch 1 onwards, the sample count carried.
    rc, second = run(argv + ["--epochs", "2"], timeout=120, cwd=str(tmp_path), **extra)
    assert rc == 0, second
    assert "resuming at epoch 1, sample 0 of the epoch, 1438 samples in all" in second, second
    assert "epoch 0 done" not in second, second
    assert "training complete: 2876 samples" in second, second


SNAPSHOT_SGD = os.path.join(os.path.dirname(EFDL), "examples", "cpp", "snapshot_sgd")


@pytest.mark.skipif(not os.access(SNAPSHOT_SGD, os.X_OK), reason="examples/cpp not built")
def test_cpp_snapshot_example_resumes_after_sigkill_with_identical_weights(tmp_path):
    def sgd(*args):
        return run([SNAPSHOT_SGD, "--steps", "300", "--commit-every", "10"] + list(args),
                   timeout=60, cwd=str(tmp_path))

    def weights(out):
        found = re.search(r"^done: 300 steps, weights-fnv1a (\w+)$", out, re.M)
        assert found, out
        return found.group(1)

    rc, clean = sgd("--job", "clean", "--arena", str(tmp_path / "clean.arena"))
    assert rc == 0, clean
    crash = ["--job", "crash", "--arena", str(tmp_path / "crash.arena"),
             "--dir", str(tmp_path / "snap")]
    rc, out = sgd(*crash, "--die-at", "174")
    assert rc == -signal.SIGKILL, out
    # The arena survived the kill: resume from memory at the last commit (step 169), and replay
    # steps 170..174 to exactly the uninterrupted run's weights.
    rc, out = sgd(*crash)
    assert rc == 0, out
    assert "restored step 169 from memory" in out, out
    assert weights(out) == weights(clean)
    # A new machine (no arena): the persisted final snapshot comes back from storage.
    os.unlink(tmp_path / "crash.arena")
    rc, out = sgd(*crash)
    assert rc == 0 and "restored step 299 from storage" in out, out
    assert weights(out) == weights(clean)


def test_examples_run_in_the_listed_order_in_one_directory_do_not_resume_each_other(tmp_path):
    """examples/README.md's commands as listed (no --job): each program has its own job id, so
    hvd_state.py does not continue train_ddp_state.py's snapshot and the torchrun launcher
    example trains its own epoch (before, all three shared job 'default')."""
    (tmp_path / "shm").mkdir()
    # TMPDIR: torchrun leaves its log directory (torchelastic_*) behind; keep it in tmp_path.
    env = {"EFDL_SHM_DIR": str(tmp_path / "shm"), "TMPDIR": str(tmp_path)}
    runs = [
        [EFDL, "run", "--", PYTHON, os.path.join(EXAMPLES, "train_ddp_state.py"), "--epochs",
         "1"],
        [EFDL, "run", "--nproc-per-node", "2", "--", PYTHON,
         os.path.join(EXAMPLES, "hvd_state.py"), "--epochs", "1"],
        [EFDL, "run", "--launcher", "--nproc-per-node", "2", "--",
         os.path.join(EXAMPLES, "launcher_torchrun.sh"), "--epochs", "1"],
    ]
    for argv in runs:
        rc, out = run(argv, timeout=180, cwd=str(tmp_path), **env)
        assert rc == 0, out[-4000:]
        assert "continues from snapshot" not in out, out[-4000:]
        assert re.search(r"resuming at epoch 0, sample 0 of the epoch, 0 samples in all", out), (
            out[-4000:])
        assert re.search(r"training complete: 1438 samples", out), out[-4000:]
    jobs = sorted(p.name for p in (tmp_path / "efdl-snapshots").iterdir())
    assert len(jobs) == 3 and all(j.startswith("local-") for j in jobs), jobs
