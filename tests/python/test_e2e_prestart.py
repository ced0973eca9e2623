"""Pre-started workers (python/efdl/preload.py), on by default for python commands: new rounds
take them, a spare serves one round only, no spare or worker outlives a SIGKILLed agent; other
commands are spawned, `--prestart` refuses them, `--no-prestart` / EFDL_PRESTART=0 turn it off.

Real etcd, real agents, real gloo workers (workers/allreduce_worker.py). Bounded in time; every
process started is killed by the fixture (by pid / process group).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import cluster  # noqa: E402
from cluster import alive, wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(cluster.efdl_bin() is None,
                                reason="efdl binary not built (set EFDL_BIN)")


@pytest.fixture
def job():
    with cluster.running("prestart-%d" % os.getpid()) as c:
        yield c


def test_rounds_take_spares_by_default_and_none_outlives_a_killed_agent(job):
    a = job.start_agent("a", nnodes="1:2")
    job.wait_for_world(1, timeout=90)
    # Worker of round 1 plus, after the refill delay, the spare for the next round.
    two = wait_for(lambda: len(a.worker_pids()) == 2 and a.worker_pids(), 60,
                   "agent a's worker and its new spare")
    b = job.start_agent("b", nnodes="1:2")
    since = time.monotonic()
    job.wait_for_world(2, since=since, timeout=90)
    out = a.output()
    assert "pre-starting 1 python worker(s) (default for python commands" in out
    # The world-2 round of a ran on the spare that waited for it: one of the two earlier
    # children is still there; the other (round 1's worker) is gone for good.
    taken = [line for line in out.splitlines() if "taken from pre-started spares" in line]
    assert len(taken) >= 2 and "1 of 1 worker(s)" in taken[-1], out[-3000:]
    now = set(a.worker_pids())
    assert len(now & set(two)) == 1, (two, now)

    # SIGKILL of the agent alone: its worker and spare die with it (PR_SET_PDEATHSIG).
    children = wait_for(lambda: len(a.worker_pids()) == 2 and a.worker_pids(), 60,
                        "agent a's refilled spare")
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in children), 30,
             "agent a's children %s to die with it" % children)
    job.wait_for_world(1, since=time.monotonic(), agents=[b], timeout=90)


def test_prestart_rejects_a_command_that_is_not_python():
    proc = subprocess.run([cluster.efdl_bin(), "run", "--prestart", "--", "/bin/true"],
                          env=cluster.base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--prestart needs a worker command" in lines[0], proc.stderr


def run_single(argv, env=None, timeout=90):
    e = cluster.base_env()
    e.update(env or {})
    return subprocess.run([cluster.efdl_bin(), "run"] + argv, env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_default_spawns_other_commands_and_no_prestart_turns_spares_off(tmp_path):
    # Not a command a spare can stand in for: spawned as before, no error, no spare.
    proc = run_single(["--", "/bin/sh", "-c", "echo plain-$RANK"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] plain-0" in proc.stdout and "pre-starting" not in proc.stderr, proc.stderr

    # What a worker sees of its own process: a spawned one is its command line; the default
    # (a spare) names itself in the argument area, `efdl-worker rank=R node=N job=J round=K`
    # cut to the length of `python3 -m efdl.preload ...` (docs/agent.md, issue #33).
    script = tmp_path / "who.py"
    script.write_text("print('cmdline', open('/proc/self/cmdline', 'rb').read()"
                      ".split(b'\\0')[1:3])\n"
                      "print('args', open('/proc/self/cmdline', 'rb').read()"
                      ".split(b'\\0')[0][:18])\n")
    cmd = ["--", cluster.PYTHON, str(script)]
    default = run_single(cmd)
    assert default.returncode == 0, default.stderr[-3000:]
    assert "1 of 1 worker(s) taken from pre-started spares" in default.stderr, default.stderr
    assert "args b'efdl-worker rank=0'" in default.stdout, default.stdout
    for off in (run_single(["--no-prestart"] + cmd), run_single(cmd, {"EFDL_PRESTART": "0"})):
        assert off.returncode == 0, off.stderr[-3000:]
        assert "pre-starting" not in off.stderr and "spares" not in off.stderr, off.stderr
        assert "cmdline [b'%s'" % script in off.stdout, off.stdout


def test_a_new_node_joins_only_once_its_spare_has_imported(job, tmp_path):
    """While the newcomer's spare imports, the running node keeps training at world size 1; the
    newcomer joins (and the world grows) only after the spare reported its imports done."""
    gate = tmp_path / "go"
    (tmp_path / "gate.py").write_text(
        "import os, time\n"
        "t = time.monotonic() + 90\n"
        "while not os.path.exists(%r) and time.monotonic() < t:\n"
        "    time.sleep(0.05)\n" % str(gate))
    a = job.start_agent("a", nnodes="1:2")
    job.wait_for_world(1, timeout=90)
    env = {"PYTHONPATH": os.path.join(cluster.REPO, "python") + os.pathsep + str(tmp_path),
           "EFDL_PRELOAD_MODULES": "gate"}
    b = job.start_agent("b", nnodes="1:2", env=env, extra=["--prestart"])
    wait_for(lambda: "waiting for 1 pre-started worker(s) to import before joining" in b.output(),
             60, "agent b to wait for its spare")
    since = time.monotonic()
    # The job goes on without b meanwhile: a keeps running steps of its world-1 round.
    job.wait_for_world(1, since=since, agents=[a], timeout=60)
    assert " joined job " not in b.output(), b.output()[-3000:]
    assert job.world_sizes_since(since, agents=[a]) == {1}
    gate.write_text("1")
    job.wait_for_world(2, since=time.monotonic(), timeout=90)
    out = b.output()
    assert out.index("pre-started worker(s) imported after") < out.index(" joined job "), out


def test_three_events_four_seconds_apart_are_all_served_by_warm_spares(job):
    """3 nodes, then a SIGKILL of one node, a new node 4 s later and a SIGTERM of another 4 s
    after that, with no wait for anything in between: every round that follows starts its
    workers from a spare on every node (the agents' logs say '1 of 1 worker(s) taken from
    pre-started spares'; a cold start would say '0 of 1'). The spares are forked from each
    node's zygote and replaced at once after each round, so the next event finds them warm."""
    nodes = [job.start_agent(n, nnodes="2:3") for n in ("n0", "n1", "n2")]
    job.wait_for_world(3, timeout=120)
    # The spares that replace round 1's are forked right after it started: let them exist.
    wait_for(lambda: all(len(a.worker_pids()) == 2 for a in nodes), 60, "every node's spare")
    nodes[2].signal_group(signal.SIGKILL)
    time.sleep(4)
    nodes.append(job.start_agent("n3", nnodes="2:3"))
    time.sleep(4)
    nodes[1].proc.send_signal(signal.SIGTERM)
    left = time.monotonic()
    job.wait_for_world(2, since=left, agents=[nodes[0], nodes[3]], timeout=90)
    for a in (nodes[0], nodes[3]):
        taken = [line for line in a.output().splitlines()
                 if "taken from pre-started spares" in line]
        assert taken and all("1 of 1 worker(s)" in line for line in taken), (
            "%s:\n%s" % (a.name, a.output()[-4000:]))
    # n0 ran every round: at least the first, after the kill and after the leave (the join may
    # have come before the round of the kill formed).
    assert len([line for line in nodes[0].output().splitlines()
                if "taken from pre-started spares" in line]) >= 3, nodes[0].output()[-4000:]


def test_the_zygote_learns_the_modules_the_programs_workers_imported(job):
    """A worker forked from the zygote reports the installed modules its program imported (2 s
    after it started); the zygote imports them too and the idle spares are forked again, so
    the next round's worker starts with them. The same program with --no-learn-imports never
    finds its module there."""
    env = {"WORKER_IMPORT": "email.mime.text"}
    a = job.start_agent("a", nnodes="1:3", env=env)
    job.wait_for_world(1, timeout=90)
    wait_for(lambda: "the zygote imported them in" in a.output(), 30, "the learned imports")
    out = a.output()
    assert re.search(r"the zygote imports \d+ more module\(s\) the program imported \(.*email",
                     out), out[-3000:]
    b = job.start_agent("b", nnodes="1:3", env=env, extra=["--no-learn-imports"])
    job.wait_for_world(2, since=time.monotonic(), timeout=90)
    preloaded = {m.group(1): m.group(2) for m in re.finditer(
        r"START round=\d+ rank=(\d+) world=2 .* preloaded=(\d)", a.output() + b.output())}
    # a leads (rank 0): its world-2 worker had the module; b, not learning, did not.
    assert preloaded == {"0": "1", "1": "0"}, (preloaded, a.output()[-3000:], b.output()[-3000:])
    assert "more module(s) the program imported" not in b.output()


def test_ps_names_each_worker_by_rank_node_and_job(job):
    """A worker forked from the zygote would read `python3 -m efdl.preload --zygote N` in ps like
    every other: it names itself (python/efdl/preload.py set_worker_title) - comm (ps -o comm)
    efdl-rank<R>, the argument area (ps -o args, /proc/PID/cmdline) `efdl-worker rank=R node=N
    job=J round=K`, cut to the area's size."""
    a = job.start_agent("a", nnodes="1", nproc=2)
    job.wait_for_world(2, timeout=90)
    titles = {}

    def named():
        for pid in a.worker_pids():
            try:
                with open("/proc/%d/comm" % pid) as f:
                    comm = f.read().strip()
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    args = f.read().split(b"\0")[0].decode()
            except OSError:
                continue
            if comm.startswith("efdl-rank"):
                titles[comm] = args
        return len(titles) == 2
    wait_for(named, 30, "two workers named efdl-rank<R> (%s)" % titles)
    assert sorted(titles) == ["efdl-rank0", "efdl-rank1"], titles
    for comm, args in titles.items():
        rank = comm[len("efdl-rank"):]
        full = "efdl-worker rank=%s node=a job=%s round=" % (rank, job.job)
        # At least "efdl-worker rank=R" fits the shortest interpreter command line.
        assert args.startswith("efdl-worker rank=%s" % rank), titles
        assert full.startswith(args) or args.startswith(full), (args, full)
    out = subprocess.run(["ps", "-o", "comm=,args=", "-p", ",".join(map(str, a.worker_pids()))],
                         capture_output=True, text=True, timeout=10).stdout
    assert "efdl-rank0" in out and "efdl-worker rank=1" in out, out
