"""efdl.backend.torch.init() and get_*: 1-process jobs, launcher env, re-execution under efdl run.

Each case that creates a process group runs in its own process: the default group is global to a
process, and pytest's process must stay clean for the other tests.
"""

import json
import os
import subprocess
import textwrap


from conftest import PYTHON

SINGLE_PROCESS = textwrap.dedent("""
    import torch, torch.distributed as dist
    import efdl.backend.torch as efdl
    before = (efdl.get_rank(), efdl.get_world_size(), efdl.get_local_rank(),
              efdl.get_local_world_size(), efdl.is_initialized())
    efdl.init(timeout=30)
    efdl.init()  # a second call is a no-op
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    model(torch.ones(4, 3)).sum().backward()
    t = torch.tensor([2.0]); dist.all_reduce(t)
    after = (efdl.get_rank(), efdl.get_world_size(), dist.get_backend(), t.item())
    print("RESULT", before, after)
""")

MULTI_PROCESS = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import efdl.backend.torch as efdl
    before = (efdl.get_rank(), efdl.get_world_size(), efdl.get_local_rank(),
              efdl.get_local_world_size())
    efdl.init(timeout=60)
    t = torch.tensor([float(efdl.get_rank() + 1)]); dist.all_reduce(t)
    sampler = efdl.data.DistributedSampler(range(10))
    print("RESULT", before, efdl.get_rank(), efdl.get_world_size(), t.item(),
          sampler.num_replicas, sampler.rank)
""")


def run(code, env, timeout=60, args=()):
    return subprocess.run([PYTHON, "-c", code] + list(args), env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_plain_python_is_a_one_process_job_with_a_real_group(clean_env):
    proc = run(SINGLE_PROCESS, clean_env)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT (0, 1, 0, 1, False) (0, 1, 'gloo', 2.0)" in proc.stdout


EXIT_TEARDOWN = textwrap.dedent("""
    import atexit, torch, torch.distributed as dist
    import efdl.backend.torch as efdl
    # Registered before init(), so it runs after efdl's own exit hook (atexit is last-in,
    # first-out): by then the group must be gone, destroyed while the interpreter was intact.
    atexit.register(lambda: print("AT EXIT initialized=%s" % dist.is_initialized(), flush=True))
    efdl.init()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    model.cycle = model  # only a garbage collection frees it (and its reference to the group)
    model(torch.ones(4, 3)).sum().backward()
""")


def test_the_group_init_created_is_destroyed_at_exit_before_interpreter_teardown(clean_env):
    # A gloo thread that frees a tensor's Python object during finalization aborts the process
    # (docs/snapshots.md, "Fixed (twice)"); tearing the group down at exit prevents it.
    proc = run(EXIT_TEARDOWN, clean_env)
    assert proc.returncode == 0, proc.stderr
    assert "AT EXIT initialized=False" in proc.stdout, proc.stdout + proc.stderr


def test_a_group_the_program_destroyed_itself_is_left_alone_at_exit(clean_env):
    proc = run("import torch.distributed as dist, efdl.backend.torch as efdl\n"
               "efdl.init(); dist.destroy_process_group(); print('DONE')", clean_env)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr


def test_launcher_env_forms_a_group_of_all_ranks_even_with_etcd_env(spawn_ranks, tmp_path):
    script, record = fake_efdl(tmp_path)
    # The agent's workers also see the etcd variables: they must not re-execute.
    results = spawn_ranks([PYTHON, "-c", MULTI_PROCESS], 3,
                          env=dict(EFDL_ETCD_ENDPOINTS="http://127.0.0.1:1", EFDL_JOB_ID="j",
                                   EFDL_BIN=str(script)))
    for rank, proc in enumerate(results):
        assert proc.returncode == 0, proc.stderr
        assert "RESULT (%d, 3, %d, 3) %d 3 6.0 3 %d" % (rank, rank, rank, rank) in proc.stdout
    assert not record.exists()


def fake_efdl(tmp_path):
    """An executable standing in for `efdl` that records how it was called (the real agent's
    behaviour is tested by the agent's own tests; here only our exec command line is checked)."""
    record = tmp_path / "argv.json"
    script = tmp_path / "efdl"
    script.write_text("#!%s\nimport json, os, sys\njson.dump({'argv': sys.argv[1:], "
                      "'marker': os.environ.get('EFDL_REEXECUTED')}, open(%r, 'w'))\n"
                      % (PYTHON, str(record)))
    script.chmod(0o755)
    return script, record


def test_etcd_env_without_agent_reexecutes_the_same_command_under_efdl_run(clean_env, tmp_path):
    script, record = fake_efdl(tmp_path)
    program = tmp_path / "train.py"
    program.write_text("import efdl.backend.torch as efdl\nefdl.init()\nprint('NOT REEXECUTED')\n")
    env = dict(clean_env, EFDL_ETCD_ENDPOINTS="http://127.0.0.1:1", EFDL_JOB_ID="job1",
               EFDL_BIN=str(script))
    proc = subprocess.run([PYTHON, "-u", str(program), "--lr", "0.1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "NOT REEXECUTED" not in proc.stdout
    called = json.loads(record.read_text())
    assert called["argv"] == ["run", "--", PYTHON, "-u", str(program), "--lr", "0.1"]
    assert called["marker"] == "1"
    assert "re-executing under" in proc.stderr


def test_etcd_env_finds_efdl_on_path(clean_env, tmp_path):
    script, record = fake_efdl(tmp_path)
    env = dict(clean_env, EFDL_ETCD_ENDPOINTS="http://127.0.0.1:1", EFDL_JOB_ID="job1",
               PATH=str(tmp_path) + os.pathsep + "/usr/bin:/bin")
    env.pop("EFDL_BIN", None)
    proc = run("import efdl.backend.torch as efdl; efdl.init()", env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(record.read_text())["argv"][:3] == ["run", "--", PYTHON]


ERROR_CASES = textwrap.dedent("""
    import json, os, sys
    import efdl.backend.torch as efdl
    base = dict(os.environ)
    for case in json.loads(sys.argv[1]):
        os.environ.clear(); os.environ.update(base); os.environ.update(case["env"])
        try:
            efdl.init(**case.get("kwargs", {}))
            print("NO ERROR", case)
        except (ValueError, RuntimeError) as e:
            print("ERROR", str(e).replace("\\n", " "))
        assert not efdl.is_initialized()
""")


def test_bad_input_gets_one_clear_error_line(clean_env, tmp_path):
    script, record = fake_efdl(tmp_path)
    no_efdl_path = str(tmp_path / "empty") + os.pathsep + "/usr/bin:/bin"
    etcd = dict(EFDL_ETCD_ENDPOINTS="http://127.0.0.1:1", EFDL_JOB_ID="job1")
    cases = [
        (dict(WORLD_SIZE="two", RANK="0"), "WORLD_SIZE='two' is not an integer"),
        (dict(WORLD_SIZE="2", RANK="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"),
         "RANK=2 is not below WORLD_SIZE=2"),
        (dict(WORLD_SIZE="2", RANK="0"), "MASTER_ADDR and MASTER_PORT not set"),
        (dict(WORLD_SIZE="0", RANK="0"), "WORLD_SIZE=0 must be >= 1"),
        (dict(etcd, PATH=no_efdl_path), "no `efdl` command was found"),
        (dict(etcd, EFDL_BIN=str(tmp_path / "missing")), "is not an executable file"),
        (dict(etcd, EFDL_BIN=str(script), EFDL_REEXECUTED="1"), "still has no RANK/WORLD_SIZE"),
    ]
    payload = [dict(env=env) for env, _ in cases] + [dict(env={}, kwargs=dict(timeout=-1))]
    env = {k: v for k, v in clean_env.items() if k != "EFDL_BIN"}
    proc = run(ERROR_CASES, env, timeout=120, args=[json.dumps(payload)])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(payload)
    for line, (_, message) in zip(lines, cases):
        assert line.startswith("ERROR") and message in line, line
    assert "timeout is in seconds" in lines[-1]
    assert not record.exists(), "the loop guard must stop before exec"


def test_get_functions_read_the_env_without_init(monkeypatch):
    import efdl.backend.torch as efdl
    for name, value in dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1",
                            LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(name, value)
    if not efdl.is_initialized():
        assert (efdl.get_rank(), efdl.get_world_size()) == (5, 8)
    assert (efdl.get_local_rank(), efdl.get_local_world_size()) == (1, 4)


def test_importing_efdl_does_not_import_torch(clean_env):
    proc = run("import sys, efdl; assert 'torch' not in sys.modules; "
               "assert efdl.data.DistributedSampler; print('ok')", clean_env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_a_rank_waits_for_rank_0s_store_polling_not_with_torchs_one_second_retry():
    """efdl.init() on a rank other than 0 first waits until rank 0's store port accepts
    connections, polling every 10 ms: torch 1.13's store client retries a refused connection
    only once per second, which cost up to a second at every round change when a rank started
    a moment before rank 0. Without anything listening it gives up after its timeout and leaves
    the error to torch."""
    import socket
    import threading
    import time

    from efdl import _dist

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    listening = {}

    def listen_later():
        time.sleep(0.3)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(4)
        listening["at"] = time.monotonic()
        listening["socket"] = s

    t = threading.Thread(target=listen_later)
    start = time.monotonic()
    t.start()
    try:
        _dist.wait_for_store("127.0.0.1", port, timeout=10)
        returned = time.monotonic()
    finally:
        t.join()
        listening["socket"].close()
    assert returned >= listening["at"], "returned before anything listened"
    assert returned - listening["at"] < 0.5, (returned - listening["at"], returned - start)

    start = time.monotonic()
    _dist.wait_for_store("127.0.0.1", port, timeout=0.3)   # nothing listens any more
    assert 0.3 <= time.monotonic() - start < 2.0
