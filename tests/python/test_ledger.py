"""The goodput ledger (issue #33, docs/operations.md "Goodput and events") through real events.

Three hosts (tests/python/workers/hosts.py) run a State program (workers/state_worker.py) with
default flags; the job goes through a crash (a host dies), a join (it comes back), a graceful
leave (SIGTERM), and a suspend and resume, then is suspended again. `efdl events --json` must
then hold one event per change, in order, each with its phases adding up to its pause; the
job's wall time split into categories that add up to it within 1%; and the steps the ledger
says were trained again equal what the workers' own output shows.
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

import cluster  # noqa: E402
import hosts  # noqa: E402

STATE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                            "state_worker.py")
ENV = {"WORKER_EPOCHS": "1000", "WORKER_STEP_TIME": "0.1", "WORKER_COMMIT_INTERVAL": "8"}

_why = hosts.HostWorld.unavailable() or (None if cluster.efdl_bin() else "efdl is not built")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))

world = pytest.fixture(cluster.host_world)

RESTORED_RE = re.compile(r"RESTORED round=(\d+) rank=\d+ world=\d+ source=\S+ seq=\d+ step=(\d+)")


def efdl(etcd, *args, timeout=90):
    out = subprocess.run([cluster.efdl_bin(), *args, "--etcd", etcd.endpoint],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def start(w, etcd, host, job):
    return cluster.start_host_agent(w, etcd, host, job, env=ENV,
                                 command=[cluster.PYTHON, STATE_WORKER])


def node_id(agent):
    """The node id an agent joined with (its default: host name, pid, 4 hex)."""
    m = re.search(r" node (\S+) joined job ", agent.output())
    assert m, agent.output()[-2000:]
    return m.group(1)


def last_step_before(agents, round_):
    """The last step done in a round before `round_` (STEP lines carry their round)."""
    return max(s[4] for a in agents for s in a.steps() if s[2] < round_)


def restored_step(agents, round_):
    found = {int(m.group(2)) for a in agents for line in a.output().splitlines()
             for m in [RESTORED_RE.search(line)] if m and int(m.group(1)) == round_}
    assert len(found) == 1, (round_, found)
    return found.pop()


def test_the_ledger_holds_each_event_its_phases_and_the_job_wall_time(world):
    w, etcd, agents = world
    job = "ledger"
    agents += [start(w, etcd, h, job) for h in w.hosts]
    cluster.wait_for_world(agents, 3, 0.0, timeout=300, live=agents)
    time.sleep(2)   # a few commits (every 8 steps of 0.1 s) before the crash; 1 s between the rest

    # A crash: the third host dies as a whole.
    lost = w.hosts[2]
    crashed_at = time.monotonic()
    lost.kill()
    cluster.wait_for_world(agents[:2], 2, crashed_at, timeout=120, live=agents[:2])
    time.sleep(1)
    # A join: the host comes back with a new agent.
    lost.start()
    joined_at = time.monotonic()
    agents.append(start(w, etcd, lost, job))
    live = [agents[0], agents[1], agents[3]]
    cluster.wait_for_world(live, 3, joined_at, timeout=300, live=live)
    time.sleep(1)
    # A graceful leave.
    left_at = time.monotonic()
    # (to the process group: the Popen is nsenter, which does not forward signals)
    os.killpg(agents[3].proc.pid, signal.SIGTERM)
    cluster.wait_for_world(agents[:2], 2, left_at, timeout=120, live=agents[:2])
    assert agents[3].proc.wait(timeout=60) != 0
    time.sleep(1)
    # A suspend, and a resume by new agents.
    assert "suspended at step" in efdl(etcd, "suspend", "--job", job, "--timeout", "60")
    for a in agents[:2]:
        assert a.proc.wait(timeout=60) == 0, a.output()[-3000:]
    time.sleep(1)
    efdl(etcd, "resume", "--job", job)
    resumed_at = time.monotonic()
    agents += [start(w, etcd, h, job) for h in w.hosts[:2]]
    cluster.wait_for_world(agents[4:], 2, resumed_at, timeout=300, live=agents[4:])
    time.sleep(1)
    efdl(etcd, "suspend", "--job", job, "--timeout", "60")
    for a in agents[4:]:
        assert a.proc.wait(timeout=60) == 0, a.output()[-3000:]

    report = json.loads(efdl(etcd, "events", "--job", job, "--json"))
    out = cluster.outputs(agents) + "\n" + json.dumps(report, indent=1)
    kinds = [e["kind"] for e in report["events"]]
    assert kinds == ["crash", "join", "leave", "resume"], out
    for e in report["events"]:
        phase_names = ("detection_s", "waiting_s", "rendezvous_s", "restore_s", "first_step_s")
        phases = sum(e[p] for p in phase_names)
        assert all(e[p] >= 0 for p in phase_names), e
        assert e["waiting_s"] == 0, e   # MIN 2: no change left fewer nodes
        assert abs(phases - e["pause_s"]) < 1e-6, e
        assert 0 < e["pause_s"] < 120, e
    crash, join, leave, resume = report["events"]
    assert (crash["world_before"], crash["world_after"]) == (3, 2), crash
    assert (join["world_before"], join["world_after"]) == (2, 3), join
    assert (leave["world_before"], leave["world_after"]) == (3, 2), leave
    assert resume["world_after"] == 2, resume
    # Which node each change took or brought.
    assert (crash["left"], crash["joined"]) == ([node_id(agents[2])], []), crash
    assert (join["left"], join["joined"]) == ([], [node_id(agents[3])]), join
    assert (leave["left"], leave["joined"]) == ([node_id(agents[3])], []), leave

    # The steps trained again are what the workers show: the last step done before the crash
    # minus the step the next round restored; none after a graceful change.
    before = last_step_before(agents[:2], crash["round"])
    assert crash["steps_lost"] == before - restored_step(agents[:2], crash["round"]), out
    for e in (join, leave, resume):
        assert e["steps_lost"] == 0, e
    # ... and their samples: steps x the samples per rank per step that EFDL's sampler counted
    # (the workers' batch: 16) x the world before (3).
    assert abs(crash["step_samples"] - 16) < 1, out
    assert crash["samples_lost"] == round(crash["steps_lost"] * crash["step_samples"] * 3), out
    # The State's restore and the first step are told apart: every rank said where its restore
    # ended (new processes after the crash: the first step is at least one 0.1 s step).
    assert crash["restore_s"] > 0 and crash["first_step_s"] >= 0.1, crash

    # The categories add up to the wall time, the suspended time is there, and goodput is the
    # share of training kept.
    total = sum(report["seconds"].values())
    assert abs(total - report["wall_s"]) <= 0.01 * report["wall_s"], out
    assert report["seconds"]["suspended"] >= 1, out
    assert report["seconds"]["lost"] >= 0, out
    assert 0 < report["goodput"] < 1, out
    assert abs(report["goodput"] - report["seconds"]["training"] / report["wall_s"]) < 1e-9
    assert report["complete"], out

    # efdl status shows the goodput and the last events.
    status = efdl(etcd, "status", "--job", job)
    print(status)   # (pytest -s: the example in docs/operations.md)
    assert re.search(r"goodput \d+\.\d% of \d+ s", status), status
    assert "resume" in status and "trained again" in status, status
