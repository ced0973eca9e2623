"""`efdl run` as a user meets it on one machine: bad input is refused with one clear line
before anything starts; without --etcd a private etcd runs a single-node job that still
restarts failed workers, up to --max-restarts."""

import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402

EFDL = cluster.efdl_bin()
pytestmark = pytest.mark.skipif(EFDL is None, reason="efdl binary not built (set EFDL_BIN)")


def run(args, timeout=30, cwd=None, extra_env=None):
    started = time.monotonic()
    env = cluster.base_env()
    env.update(extra_env or {})
    proc = subprocess.run([EFDL] + args, env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    return proc, time.monotonic() - started


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("args, expected", [
    (["--bogus-flag", "--", "true"], "--bogus-flag"),
    (["--nnodes", "3:2", "--etcd", "127.0.0.1:2379", "--job", "j", "--", "true"],
     "MIN 3 is greater than MAX 2"),
    (["--nnodes", "two", "--", "true"], "--nnodes"),
    (["--etcd", "127.0.0.1:2379", "--job", "bad/job", "--", "true"], "job id 'bad/job'"),
    (["--", "efdl-no-such-training-program"], "efdl-no-such-training-program"),
    (["--etcd", "127.0.0.1:2379", "--", "true"], "--job is required"),
    (["--nnodes", "2:3", "--", "true"], "--etcd"),
    (["--etcd", "127.0.0.1:notaport", "--job", "j", "--", "true"], "--etcd"),
    (["--ttl", "0", "--", "true"], "--ttl"),
    # Network overrides this host does not have (203.0.113.0/24 is for documentation only).
    (["--iface", "efdl-no-such-if0", "--", "true"], "--iface efdl-no-such-if0: this host has no"),
    (["--advertise-addr", "203.0.113.7", "--", "true"],
     "--advertise-addr 203.0.113.7 is not an address of this host"),
])
def test_bad_input_gets_one_clear_line(args, expected):
    proc, took = run(["run"] + args)
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert lines and expected in lines[0], proc.stderr
    assert len(lines) <= 2, proc.stderr        # ours: 1; CLI11 adds a "--help" hint
    assert proc.stdout == ""
    # Bad input is refused before etcd is contacted: no connection timeout is waited for.
    assert took < 30, "refusing bad input took %.1f s: did it wait for etcd?" % took


def test_unreachable_etcd_is_reported_before_anything_starts(tmp_path):
    port = cluster.free_port()
    marker = tmp_path / "started"
    proc, took = run(["run", "--etcd", "127.0.0.1:%d" % port, "--job", "j", "--",
                      "sh", "-c", "touch %s" % marker], timeout=60)
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert "127.0.0.1:%d" % port in lines[0]
    assert not marker.exists()
    assert took < 30


def test_bad_environment_variable_is_refused_like_the_flag():
    env = cluster.base_env()
    env["EFDL_NNODES"] = "5:1"
    proc = subprocess.run([EFDL, "run", "--etcd", "127.0.0.1:2379", "--job", "j", "--", "true"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "MIN 5 is greater than MAX 1" in proc.stderr


def test_standalone_job_runs_workers_with_their_environment(tmp_path):
    proc, _ = run(["run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                   "--node-id", "solo", "--",
                   "sh", "-c", "echo hello rank=$RANK of=$WORLD_SIZE local=$LOCAL_RANK "
                               "sock=${EFDL_CONTROL_SOCKET:+yes} omp=$OMP_NUM_THREADS"],
                  timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] hello rank=0 of=2 local=0 sock=yes" in proc.stdout
    assert "[rank 1] hello rank=1 of=2 local=1 sock=yes" in proc.stdout
    logs = list((tmp_path / "logs" / "solo").iterdir())
    assert len(logs) == 2
    assert any("hello rank=1" in p.read_text() for p in logs)


def test_standalone_job_restarts_failed_workers_up_to_max_restarts(tmp_path):
    proc, _ = run(["run", "--max-restarts", "2", "--",
                   "sh", "-c", "echo attempt $EFDL_RESTART_COUNT round $EFDL_ROUND; exit 3"],
                  timeout=90, cwd=tmp_path)
    assert proc.returncode != 0
    for attempt in range(3):
        assert "[rank 0] attempt %d" % attempt in proc.stdout, proc.stdout
    assert "attempt 3" not in proc.stdout
    assert "rank 0 exited with status 3" in proc.stderr
    assert "max-restarts 2" in proc.stderr


def test_sigterm_stops_a_standalone_job_and_its_workers(tmp_path):
    pidfile = tmp_path / "worker.pid"
    proc = subprocess.Popen([EFDL, "run", "--", "sh", "-c", "echo $$ > %s; exec sleep 60" %
                             pidfile], env=cluster.base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        cluster.wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 30,
                         "the worker to start (its pid file)")
        worker = int(pidfile.read_text())
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + 15
        with pytest.raises(ProcessLookupError):
            for _ in range(100):
                os.kill(worker, 0)
                time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


STATE_WORKER = """
import os, sys, torch
import efdl.backend.torch as efdl
state = efdl.State(torch.nn.Linear(2, 2), step=0)
for state.step in range(3):
    state.commit()
print("arena exists during training:", os.path.exists(state.arena_path))
"""


def test_completed_job_removes_its_shared_memory_arenas(tmp_path):
    import fcntl
    shm = tmp_path / "shm"
    shm.mkdir()
    # Another job's arena whose holder lock a live process (this test) holds: must stay.
    other = shm / "efdl-another-job-solo.0-node.arena"
    other.write_bytes(b"x")
    other_lock = open(shm / "efdl-another-job-solo.0.lock", "w")
    fcntl.flock(other_lock, fcntl.LOCK_EX)
    # A dead one (no live holder): the next `efdl run` on this host removes it.
    dead = shm / "efdl-gone-job-solo.3-node.arena"
    dead.write_bytes(b"x")
    try:
        proc, _ = run(["run", "--job", "arenas", "--node-id", "solo",
                       "--snapshot-dir", str(tmp_path / "snap"), "--",
                       sys.executable, "-c", STATE_WORKER],
                      timeout=120, cwd=tmp_path, extra_env={"EFDL_SHM_DIR": str(shm)})
    finally:
        other_lock.close()
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] arena exists during training: True" in proc.stdout
    assert sorted(p.name for p in shm.iterdir()) == sorted([other.name, other_lock.name.split(
        "/")[-1]])
    assert list((tmp_path / "snap" / "arenas").iterdir()), "the final snapshot was persisted"


# -- the command line as a new user types it (issue #22) -------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["run", "--nnode", "2", "--", "/usr/bin/python3", "x.py", "--epochs", "1"],
     ["unknown option '--nnode'", "did you mean '--nnodes'?"]),
    (["run", "--nproc_per_nod", "2", "--", "true"],
     ["unknown option '--nproc_per_nod'", "did you mean '--nproc-per-node'?"]),
    (["stauts"], ["unknown command 'stauts'", "did you mean 'status'?"]),
    ([], ["no command given", "run, status"]),
    (["run", "--nnodes", "2", "/usr/bin/python3", "x.py", "--epochs", "1"],
     ["put `--` between efdl's options and the training command", "'--epochs'"]),
    (["run", "--rdzv_endpoint", "h:29400", "--", "true"], ["torchrun's", "--etcd HOST:PORT"]),
    (["run", "--node_rank", "1", "--", "true"], ["torchrun's", "drop it"]),
])
def test_a_mistyped_command_line_names_the_word_and_what_to_use(args, expected):
    proc, _ = run(args)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    for word in expected:
        assert word in lines[0], proc.stderr
    assert "x.py" not in lines[0] and "not expected" not in lines[0], proc.stderr


def test_torchrun_spellings_of_efdl_flags_are_accepted():
    # --nproc_per_node and --rdzv_id mean --nproc-per-node and --job: the run gets as far as
    # checking the job id (an invalid one), past the command line.
    proc, _ = run(["run", "--nproc_per_node", "1", "--rdzv_id", "bad/id", "--", "true"])
    assert proc.returncode == 2
    assert "job id 'bad/id'" in proc.stderr, proc.stderr


def test_run_help_and_the_flags_table_of_docs_agent_md_agree():
    """Every flag of `efdl run --help` has a row in docs/agent.md's flags table and the other way
    round; a default the help shows (FLAG TYPE=VALUE) is the one the table gives."""
    import re
    proc, _ = run(["run", "--help"])
    assert proc.returncode == 0
    help_flags = {}
    for m in re.finditer(r"^\s+(--[a-z-]+)(?: [A-Z]+(?:=(\S+))?)?", proc.stdout, re.M):
        help_flags[m.group(1)] = m.group(2)
    help_flags.pop("--help", None)
    with open(os.path.join(cluster.REPO, "docs", "agent.md")) as f:
        doc = f.read()
    table = doc[doc.index("| flag | default |"):]
    table = table[:table.index("\n\n")]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for flag in re.findall(r"`(--[a-z-]+)`", cells[0]):
            rows[flag] = cells[1]
    assert set(help_flags) == set(rows), (
        "only in --help: %s; only in docs/agent.md: %s"
        % (sorted(set(help_flags) - set(rows)), sorted(set(rows) - set(help_flags))))
    for flag, default in help_flags.items():
        if default is not None:
            assert re.search(r"(^|[ `])%s([ `]|$)" % re.escape(default), rows[flag]), (
                "%s: --help says %s, docs/agent.md says %r" % (flag, default, rows[flag]))


STATE_PROGRAM = r"""
import torch, efdl.backend.torch as efdl
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = efdl.State(model, opt, epoch=0, step=0)
for _ in range(3):
    state.step += 1
    state.commit()
print("trained to step", state.step)
"""


def test_a_resumed_run_says_what_it_continues_and_efdl_reset_starts_over(tmp_path):
    """A program using State without an agent: its second run announces the snapshot it
    continues from (job, step, where, age) and how to start over; after `efdl reset` the next
    run starts from the beginning without that line."""
    script = tmp_path / "train.py"
    script.write_text(STATE_PROGRAM)
    shm = tmp_path / "shm"
    shm.mkdir()
    env = cluster.base_env()
    env.update({"EFDL_SNAPSHOT_DIR": str(tmp_path / "snaps"), "EFDL_SHM_DIR": str(shm),
                "EFDL_JOB_ID": "announce"})

    def train():
        return subprocess.run([cluster.PYTHON, str(script)], env=env, capture_output=True,
                              text=True, timeout=120, cwd=str(tmp_path))
    first = train()
    assert first.returncode == 0, first.stderr
    assert "trained to step 3" in first.stdout and "continues from" not in first.stderr
    second = train()
    assert second.returncode == 0, second.stderr
    assert "trained to step 6" in second.stdout, second.stdout
    line = [l for l in second.stderr.splitlines() if "continues from" in l]
    assert len(line) == 1, second.stderr
    assert re.search(r"efdl: job 'announce' continues from snapshot \d+ \(step 3, epoch 0\) in "
                     r".*snaps.*, written \d+ s ago; to start over: `efdl reset --job announce` "
                     r"first", line[0]), line[0]
    reset = subprocess.run([EFDL, "reset", "--job", "announce", "--snapshot-dir",
                            str(tmp_path / "snaps")], env=env, capture_output=True, text=True,
                           timeout=60)
    assert reset.returncode == 0, reset.stderr
    assert "moved the job's snapshots" in reset.stdout, reset.stdout
    assert any(p.name.startswith("announce.reset-") for p in (tmp_path / "snaps").iterdir())
    third = train()
    assert "trained to step 3" in third.stdout and "continues from" not in third.stderr, (
        third.stdout + third.stderr)


def test_restore_hint_and_reset_of_a_running_job_say_what_to_do(tmp_path):
    """Under `efdl run` without --etcd the "to start over" hint is `efdl reset --job J` (no
    --etcd: the job has no shared etcd); `efdl reset` of a job whose process still runs on this
    host refuses and names `efdl suspend` and stopping its agents, as docs/troubleshooting.md."""
    script = tmp_path / "train.py"
    script.write_text(STATE_PROGRAM)
    shm = tmp_path / "shm"
    shm.mkdir()
    snaps = str(tmp_path / "snaps")
    env = {"EFDL_SHM_DIR": str(shm)}
    argv = ["run", "--job", "hint", "--snapshot-dir", snaps, "--", cluster.PYTHON, str(script)]
    first, _ = run(argv, timeout=120, cwd=str(tmp_path), extra_env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    second, _ = run(argv, timeout=120, cwd=str(tmp_path), extra_env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout + second.stderr
    line = [l for l in out.splitlines() if "continues from" in l]
    assert len(line) == 1, out[-3000:]
    assert "to start over: `efdl reset --job hint` first" in line[0], line[0]

    # A process of the job that holds its arena on this host: reset refuses and says how.
    holder = subprocess.Popen(
        [cluster.PYTHON, "-c", STATE_PROGRAM + "\nimport sys, time\nprint('held', flush=True)\n"
         "sys.stdin.read()\n"], env=dict(cluster.base_env(), EFDL_SHM_DIR=str(shm),
                                        EFDL_SNAPSHOT_DIR=snaps, EFDL_JOB_ID="hint"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        cwd=str(tmp_path))
    try:
        assert holder.stdout.readline().startswith("trained to step")
        assert holder.stdout.readline().strip() == "held"
        proc, _ = run(["reset", "--job", "hint", "--snapshot-dir", snaps], extra_env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = error_lines(proc)
        assert len(lines) == 1, lines
        assert re.match(r"efdl reset: error: job 'hint' is running on this host: a live process "
                        r"holds its shared-memory arena .*; stop it first \(`efdl suspend --job "
                        r"hint` for a job run with --etcd, or stop its agents / program\), then "
                        r"reset$", lines[0]), lines[0]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_usage_lines_name_the_program():
    """CLI11's usage lines start with the program's name: `Usage: efdl run [OPTIONS] ...`, not
    `Usage: run [OPTIONS] ...`."""
    top, _ = run(["--help"])
    assert top.returncode == 0 and "Usage: efdl [OPTIONS] SUBCOMMAND" in top.stdout, top.stdout
    for sub in ("run", "status", "reset"):
        proc, _ = run([sub, "--help"])
        assert proc.returncode == 0, proc.stderr
        assert "Usage: efdl %s [OPTIONS]" % sub in proc.stdout, proc.stdout
