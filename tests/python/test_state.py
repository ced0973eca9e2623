"""efdl.State: restore at construction, commit interval, mismatch errors, crash and failure paths.

Every test uses its own job id, snapshot directory and shared-memory directory (EFDL_SHM_DIR in
the test's tmp_path), so nothing is left in /dev/shm and tests do not see each other's snapshots.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from conftest import PYTHON, clean_environment

from efdl import state as efdl_state
from efdl.state import SnapshotError, SnapshotMismatchError, State

TIMEOUT = 60


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A fresh job: its id, snapshot dir and shm dir, set in this process's environment."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EFDL_CONTROL_SOCKET",
                "EFDL_SNAPSHOT_PER_RANK", "EFDL_AGENT_PERSISTS", "EFDL_PERSIST_MIN_INTERVAL_MS"):
        monkeypatch.delenv(var, raising=False)
    env = {"EFDL_JOB_ID": "test-" + tmp_path.name, "EFDL_SNAPSHOT_DIR": str(tmp_path / "snaps"),
           "EFDL_SHM_DIR": str(tmp_path / "shm"),
           # The test process restores what the tests' own scripts wrote (another program).
           "EFDL_RESTORE_OTHER_PROGRAM": "1"}
    os.makedirs(env["EFDL_SHM_DIR"])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def make_training(seed=0, hidden=8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler=None):
    x = torch.randn(4, 6)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0]))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def forget_memory(job):
    """Drops the node's shared-memory copy: what a new node (or a rebooted one) sees."""
    for name in os.listdir(job["EFDL_SHM_DIR"]):
        os.unlink(os.path.join(job["EFDL_SHM_DIR"], name))


def restore_from_storage_warned(job, match):
    """A new node's restore (the memory copy forgotten) into a fresh make_training(seed=9),
    which must warn with `match`; returns the State and its model."""
    forget_memory(job)
    model, optimizer, _ = make_training(seed=9)
    with pytest.warns(UserWarning, match=match):
        restored = State(model, optimizer, step=0)
    return restored, model


def storage_files(job):
    d = os.path.join(job["EFDL_SNAPSHOT_DIR"], job["EFDL_JOB_ID"])
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.startswith("snap-"))


def test_restore_at_construction_gives_epoch_and_weights_back(job):
    model, optimizer, scheduler = make_training()
    state = State(model, optimizer, scheduler, epoch=0, step=0, world_size=1)
    assert state.restored_from is None and state.epoch == 0
    for step in range(1, 4):
        train_step(model, optimizer, scheduler)
        state.step = step
        state.commit()
    state.epoch = 10
    state.commit()
    state.flush()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state[model[0].weight]["momentum_buffer"].clone()
    lr = optimizer.param_groups[0]["lr"]

    for source in ("memory", "storage"):
        if source == "storage":
            forget_memory(job)
        m2, o2, s2 = make_training(seed=1)
        restored = State(m2, o2, s2, epoch=0, step=0, world_size=1)
        assert restored.restored_from[0] == source
        assert (restored.epoch, restored.step, restored.world_size) == (10, 3, 1)
        for k, v in m2.state_dict().items():
            assert torch.equal(v, saved[k]), k
        assert torch.equal(o2.state[m2[0].weight]["momentum_buffer"], momentum)
        assert o2.param_groups[0]["lr"] == lr
        assert s2.last_epoch == scheduler.last_epoch
        # Training goes on identically from the restored state.
        m3, o3, s3 = make_training(seed=1)
        State(m3, o3, s3, epoch=0, step=0)
        torch.manual_seed(5)
        train_step(m2, o2, s2)
        torch.manual_seed(5)
        train_step(m3, o3, s3)
        assert torch.equal(m2[2].weight, m3[2].weight)


def test_commit_interval_is_honoured_against_state_step(job):
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0)
    state.set_commit_interval(5)
    taken = []
    for step in range(1, 13):
        state.step = step
        if state.commit():
            taken.append(step)
    assert taken == [5, 10]
    state.flush()
    forget_memory(job)
    assert State(step=0).step == 10
    with pytest.raises(ValueError):
        state.set_commit_interval(0)


def test_without_a_step_value_snapshots_continue_the_restored_commit_count(job):
    """A State without a "step" value (Horovod's elastic states) numbers its snapshots by
    commit() calls: a process that restored the snapshot of step S numbers its next commit S + 1,
    not 0 (else its rank's pause reported one counter and the round another, issue #33)."""
    model, optimizer, _ = make_training()
    first = State(model, optimizer, epoch=0)
    for _ in range(5):
        first.commit()
    assert first._last_step == 4
    first.flush()
    forget_memory(job)   # the next State is another process' (a new node's): storage only
    m2, o2, _ = make_training(seed=1)
    second = State(m2, o2, epoch=0)
    assert second.restored_from is not None and second._restored.step == 4
    second.commit()
    assert second._last_step == 5
    second.commit()
    assert second._last_step == 6


def test_attributes_setters_and_unknown_kwargs(job):
    model, optimizer, scheduler = make_training()
    state = State(epoch=2, step=0, note="hello", table={"a": (1, 2)}, counts=torch.arange(4))
    state.step = 5
    state.extra = 1.5  # set later: still user state
    with pytest.raises(AttributeError, match="keyword argument"):
        state.missing
    state.set_and_resotre_model(model)
    state.set_and_resotre_optimizer(optimizer)
    state.set_and_restore_scheduler(scheduler)
    assert state.model is model and state.optimizer is optimizer
    train_step(model, optimizer, scheduler)
    state.commit()
    state.flush()

    # A program that only knows some of the names gets the others back as saved, and objects
    # given later through the setters are restored from the same snapshot.
    fresh = State(epoch=0)
    assert (fresh.epoch, fresh.step, fresh.note, fresh.extra) == (2, 5, "hello", 1.5)
    assert fresh.table == {"a": (1, 2)}
    assert torch.equal(fresh.counts, torch.arange(4))
    m2, o2, s2 = make_training(seed=3)
    fresh.set_and_restore_model(m2)
    fresh.set_and_restore_optimizer(o2)
    fresh.set_and_restore_scheduler(s2)
    assert torch.equal(m2[0].weight, model[0].weight)
    assert s2.last_epoch == scheduler.last_epoch


def test_mismatched_model_is_a_clear_error_and_changes_nothing(job):
    model, optimizer, _ = make_training(hidden=8)
    state = State(model, optimizer, step=0)
    train_step(model, optimizer)
    state.commit()

    wider, _, _ = make_training(hidden=9)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(SnapshotMismatchError, match=r"'0.weight' has shape \[8, 6\] in the "
                                                    r"snapshot but \[9, 6\]"):
        State(wider)
    for k, v in wider.state_dict().items():
        assert torch.equal(v, before[k]), "a failed restore modified the model"

    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
                                torch.nn.Linear(3, 3))
    with pytest.raises(SnapshotMismatchError, match=r"model key '3.weight' is missing"):
        State(other)

    two_groups = torch.optim.SGD([{"params": model[0].parameters()},
                                  {"params": model[2].parameters()}], lr=0.1)
    with pytest.raises(SnapshotMismatchError, match="parameter groups"):
        State(model, two_groups)


def test_corrupt_newest_file_falls_back_to_the_previous_one(job):
    model, optimizer, _ = make_training()
    state = State(model, optimizer, step=0)
    for step in (1, 2):
        train_step(model, optimizer)
        state.step = step
        state.commit()
        state.flush()
        if step == 1:
            first = {k: v.clone() for k, v in model.state_dict().items()}
    files = storage_files(job)
    assert len(files) == 2
    with open(files[-1], "r+b") as f:  # flip a byte of the first tensor (data starts at 4 KiB)
        f.seek(4096 + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    restored, m2 = restore_from_storage_warned(job, "failed its data checksum")
    assert restored.step == 1
    for k, v in m2.state_dict().items():
        assert torch.equal(v, first[k]), k


WRITER = textwrap.dedent("""
    import os, signal, sys, time, torch
    import efdl.backend.torch as efdl
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = efdl.State(model, opt, epoch=0, step=0)
    mode = sys.argv[1]
    for step in range(1, 1000000):
        loss = model(torch.randn(4, 6)).sum()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step = step
        state.commit()
        print("committed", step, float(model.weight.sum()), flush=True)
        if mode == "kill" and step == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "slow":
            time.sleep(0.01)
""")

READER = textwrap.dedent("""
    import json, torch
    import efdl.backend.torch as efdl
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = efdl.State(model, opt, epoch=0, step=0)
    print(json.dumps({"from": state.restored_from, "step": state.step,
                      "wsum": float(model.weight.sum())}))
""")


def run_script(tmp_path, source, args, env, **kwargs):
    path = tmp_path / "script.py"
    path.write_text(source)
    full = clean_environment()
    full.update(env)
    return subprocess.run([PYTHON, str(path)] + args, env=full, capture_output=True, text=True,
                          timeout=TIMEOUT, **kwargs)


def last_committed(stdout):
    lines = [l.split() for l in stdout.splitlines() if l.startswith("committed")]
    return int(lines[-1][1]), float(lines[-1][2])


def test_killed_writer_is_restored_from_shared_memory(job, tmp_path):
    # The worker never persists (as under an agent that persists for it): only memory has it.
    env = dict(job, EFDL_AGENT_PERSISTS="1")
    w = run_script(tmp_path, WRITER, ["kill"], env)
    assert w.returncode == -signal.SIGKILL, w.stderr
    step, wsum = last_committed(w.stdout)
    assert step == 7
    r = run_script(tmp_path, READER, [], env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["from"][0] == "memory" and out["step"] == 7
    assert out["wsum"] == pytest.approx(wsum, abs=1e-5)


def test_sigterm_persists_the_newest_snapshot_before_exit(job, tmp_path):
    # Rate-limit the background persister so that storage lags behind memory until SIGTERM.
    env = dict(job, EFDL_PERSIST_MIN_INTERVAL_MS="600000")
    path = tmp_path / "writer.py"
    path.write_text(WRITER)
    full = clean_environment()
    full.update(env)
    proc = subprocess.Popen([PYTHON, str(path), "slow"], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("committed 20 "):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    step = max([20] + [int(l.split()[1]) for l in out.splitlines() if l.startswith("committed")])
    forget_memory(job)
    r = run_script(tmp_path, READER, [], env)
    assert r.returncode == 0, r.stderr
    restored = json.loads(r.stdout.strip().splitlines()[-1])
    assert restored["from"][0] == "storage"
    assert restored["step"] == step


def test_persistence_failure_is_reported_and_training_continues(job, tmp_path):
    script = textwrap.dedent("""
        import resource, signal, torch
        import efdl.backend.torch as efdl
        model = torch.nn.Linear(200, 200)
        state = efdl.State(model, step=0)
        state.commit(); state.flush()          # one good snapshot in storage
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50000, 50000))   # storage is "full" now
        for step in range(1, 30):
            with torch.no_grad():
                model.weight.add_(1.0)
            state.step = step
            assert state.commit()
        try:
            state.flush(timeout=20)
            print("flush ok")
        except efdl.SnapshotError as e:
            print("flush failed:", e)
        print("error:", state.last_persist_error())
        print("trained to", state.step)
    """)
    r = run_script(tmp_path, script, [], job)
    assert r.returncode == 0, r.stderr
    assert "flush failed" in r.stdout and "File too large" in r.stdout, r.stdout
    assert "trained to 29" in r.stdout
    assert "previous snapshot is kept and training continues" in r.stderr
    files = storage_files(job)
    assert len(files) == 1
    forget_memory(job)
    assert State(step=-1).step == 0  # the good snapshot is still there


class FakeAgent:
    """The agent's side of the control socket (docs/control-protocol.md), enough for one worker:
    welcome, then a graceful stop once `stop` is set; records what the worker sends."""

    def __init__(self, path):
        self.path = path
        self.messages = []
        self.stop = threading.Event()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.server.settimeout(TIMEOUT)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.server.accept()
        conn.settimeout(0.05)
        buf = b""
        stopped = False
        with conn:
            while True:
                if self.stop.is_set() and not stopped:
                    conn.sendall(b'{"type":"stop","round":0,"graceful":true,"reason":"test"}\n')
                    stopped = True
                try:
                    chunk = conn.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    self.messages.append(msg)
                    if msg["type"] == "hello":
                        conn.sendall(b'{"type":"welcome","version":1,"round":0,"job_id":"j",'
                                     b'"node_id":"n"}\n')


def test_graceful_stop_snapshots_off_interval_persists_and_exits_zero(job, tmp_path):
    agent = FakeAgent(str(tmp_path / "agent.sock"))
    script = textwrap.dedent("""
        import sys, time, torch
        import efdl.backend.torch as efdl
        model = torch.nn.Linear(6, 3)
        state = efdl.State(model, step=0)
        state.set_commit_interval(1000)
        for step in range(1, 100000):
            state.step = step
            state.commit()
            if step == 50:
                print("ready", flush=True)
            time.sleep(0.002)
        sys.exit(3)
    """)
    path = tmp_path / "w.py"
    path.write_text(script)
    env = clean_environment()
    env.update(job, EFDL_CONTROL_SOCKET=agent.path)
    proc = subprocess.Popen([PYTHON, str(path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        agent.stop.set()
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    agent.thread.join(TIMEOUT)
    stopping = [m for m in agent.messages if m["type"] == "stopping"]
    assert len(stopping) == 1 and stopping[0]["snapshot"] is True
    step = stopping[0]["step"]
    assert step > 50
    forget_memory(job)
    assert State(step=0).step == step  # snapshotted off the 1000-step interval, and persisted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tensors_are_copied_device_to_host(job):
    model = torch.nn.Linear(16, 4).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model, optimizer, step=0)
    train_step_gpu = lambda: model(torch.randn(2, 16, device="cuda")).sum().backward()
    train_step_gpu()
    optimizer.step()
    state.commit()
    m2 = torch.nn.Linear(16, 4).cuda()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    State(m2, o2, step=0)
    assert torch.equal(m2.weight, model.weight)
    assert o2.state[m2.weight]["momentum_buffer"].is_cuda


def as_rank(monkeypatch, rank, local_rank, world=2):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))


def test_node_copy_is_written_by_local_rank_zero_and_read_by_every_rank(job, monkeypatch):
    model, optimizer, _ = make_training()
    as_rank(monkeypatch, 1, 1)
    other = State(make_training(seed=4)[0], step=0)
    other.step = 3
    assert other.commit() is False  # not the node's writer: nothing is copied
    as_rank(monkeypatch, 0, 0)
    writer = State(model, step=0)
    writer.step = 3
    assert writer.commit() is True
    as_rank(monkeypatch, 1, 1)
    m2 = make_training(seed=5)[0]
    reader = State(m2, step=0)
    assert reader.restored_from[0] == "memory" and reader.step == 3
    assert torch.equal(m2[0].weight, model[0].weight)


def test_per_rank_snapshots_keep_each_ranks_own_state(job, monkeypatch):
    monkeypatch.setenv("EFDL_SNAPSHOT_PER_RANK", "1")
    shards = {}
    for rank in (0, 1):
        as_rank(monkeypatch, rank, rank)
        shard = torch.full((4,), float(rank))
        st = State(shard=shard, step=0)
        st.step = 10 + rank
        assert st.commit()
        st.flush()
        shards[rank] = shard
    forget_memory(job)
    for rank in (0, 1):
        as_rank(monkeypatch, rank, rank)
        st = State(step=0)
        assert st.restored_from[0] == "storage"
        assert st.step == 10 + rank
        assert torch.equal(st.shard, shards[rank])
    base = os.path.join(job["EFDL_SNAPSHOT_DIR"], job["EFDL_JOB_ID"])
    assert sorted(os.listdir(base)) == ["rank-0", "rank-1"]


def test_the_default_job_id_is_the_programs_and_keeps_its_old_value(tmp_path):
    """Without EFDL_JOB_ID a program's State uses local-<stem>-<8 hex>: the same id `efdl run`
    gives the program without --etcd (one owner: efdl._efdl.local_job_id), and the value earlier
    releases computed in Python (SHA-1 of the real path), so existing snapshots are still found."""
    import hashlib
    from efdl import _efdl
    script = tmp_path / "my train.py"
    script.write_text("")
    path = os.path.realpath(str(script))
    old = "local-%s-%s" % ("my_train", hashlib.sha1(path.encode()).hexdigest()[:8])
    assert _efdl.local_job_id(path) == old
    assert _efdl.local_job_id(str(script)) == old
    other = tmp_path / "other.py"
    other.write_text("")
    assert _efdl.local_job_id(str(other)) != old
    assert _efdl.local_job_id("").startswith("local-python-")
