"""Stragglers (issue #32 part 3, docs/operations.md "Stragglers") on three simulated hosts.

Each host (tests/python/workers/hosts.py) runs `efdl run` with the digits DDP program and State
(workers/state_worker.py); one host's workers sleep WORKER_SLOW_MS more per step before their
forward pass (its compute time grows, its peers wait in the all-reduce instead).

- Default flags but a 6 s --straggler-window, the shortest allowed (EFDL_TEST_DEFAULT_WINDOW=1,
  which `make soak` sets, runs it with the default 30 s window: about 60 s longer): while the
  three nodes are equal (longer than a whole --straggler-window and its first judgement), nobody
  is named (no log line, no STRAGGLER in `efdl status`, every node's efdl_straggler 0). Then the
  slow host is named within the documented bound (the window, one more period for its summaries
  to be read, half a period for the judge's phase):
  by the judge's log line (job, round, node, rank, its time vs the median), `efdl status`, and
  its own efdl_straggler 1 and efdl_rank_compute_seconds; it stays in the job.
  The live page (`efdl dashboard` in headless Chromium, as tests/python/test_dashboard.py)
  lists it as a straggler with its rank's compute time.
- --evict-stragglers (and the 6 s window to keep the test short): the slow host is named and
  evicted (its exclusion record says "straggler"), the job goes on at world size 2, and the
  throughput (samples per second, from the workers' STEP lines) rose; both are printed. At
  --nnodes 2:2 (MIN 2) the named node cannot be evicted: it says so once and stays.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))

import cluster  # noqa: E402
import hosts  # noqa: E402

STATE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                            "state_worker.py")
BATCH = 16
ENV = {"WORKER_EPOCHS": "1000", "WORKER_STEP_TIME": "0.1", "WORKER_COMMIT_INTERVAL": "4",
       "WORKER_BATCH": str(BATCH)}
SLOW_MS = 300
DEFAULT_WINDOW = 30.0    # --straggler-window's default
# The shortest --straggler-window allowed (3 summaries of straggler_rules.h's kMinPeriod, 2 s).
SHORT_WINDOW = 6.0
# The "nobody named, then the slow node named" case at the default window takes about 95 s; CI
# runs it with the window the other cases use, `make soak` with the default.
WINDOW = DEFAULT_WINDOW if os.environ.get("EFDL_TEST_DEFAULT_WINDOW") == "1" else SHORT_WINDOW
PERIOD = WINDOW / 3      # straggler_rules.h PublishPeriod at 3 nodes

_why = hosts.HostWorld.unavailable() or (None if cluster.efdl_bin() else "efdl is not built")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))

world = pytest.fixture(cluster.host_world)


def start(w, etcd, host, job, extra=(), env=None, nnodes="2:3"):
    if WINDOW != DEFAULT_WINDOW and "--straggler-window" not in extra:
        extra = list(extra) + ["--straggler-window", "%g" % WINDOW]
    return cluster.start_host_agent(w, etcd, host, job, extra=extra, env=dict(ENV, **(env or {})),
                                 command=[cluster.PYTHON, STATE_WORKER], nnodes=nnodes)


def node_id(agent):
    m = re.search(r" node (\S+) joined job ", agent.output())
    assert m, agent.output()[-2000:]
    return m.group(1)


def status(etcd, job):
    out = subprocess.run([cluster.efdl_bin(), "status", "--job", job, "--etcd", etcd.endpoint],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.stdout, out.stderr)
    return out.stdout


def metric(host, name):
    """{labels text: value} of `name` on the agent of `host` (its default port 9441)."""
    with urllib.request.urlopen("http://%s:9441/metrics" % host.addr, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"%s(\{[^}]*\})? (\S+)$" % re.escape(name), line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def page_dom(etcd, job):
    """The DOM of `efdl dashboard`'s page for `job` once it polled, in headless Chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "no headless browser (apt: chromium; scripts/install-deps)"
    dash = subprocess.Popen([cluster.efdl_bin(), "dashboard", "--etcd", etcd.endpoint, "--job",
                             job, "--port", str(cluster.free_port()), "--poll", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    browser_dir = tempfile.mkdtemp(prefix="efdl-strag-chromium-")
    try:
        m = re.search(r"at (http://127\.0\.0\.1:\d+/) ", dash.stdout.readline())
        assert m, dash.stderr.read() if dash.poll() is not None else "no URL"
        time.sleep(2)   # a few polls
        env = dict(os.environ, HOME=browser_dir, TMPDIR=browser_dir, XDG_CONFIG_HOME=browser_dir,
                   XDG_CACHE_HOME=browser_dir)
        browser = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--disable-extensions",
             "--user-data-dir=" + os.path.join(browser_dir, "profile"),
             "--virtual-time-budget=4000", "--dump-dom", m.group(1)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            start_new_session=True)
        try:
            out, err = browser.communicate(timeout=60)
        finally:
            try:
                os.killpg(browser.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            browser.wait()
        assert browser.returncode == 0, err[-2000:]
        return out
    finally:
        dash.send_signal(signal.SIGTERM)
        try:
            dash.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            dash.kill()
            dash.communicate()
        shutil.rmtree(browser_dir, ignore_errors=True)


def named_lines(agents, job):
    return [line for a in agents for line in a.output().splitlines()
            if re.search(r"job %s round \d+: node \S+ is a straggler" % job, line)]


def throughput(agents, world_size, since, until):
    """Samples per second of the job's rounds of `world_size` between `since` and `until`, from
    rank 0's STEP lines (each step trains BATCH samples on each of the world's ranks)."""
    steps = sorted((t, step) for a in agents for t, rank, _r, w, step in a.steps(since)
                   if rank == 0 and w == world_size and t <= until)
    assert len(steps) >= 5, (world_size, steps)
    (t0, s0), (t1, s1) = steps[0], steps[-1]
    return (s1 - s0) * BATCH * world_size / (t1 - t0)


def test_equal_nodes_are_not_named_and_a_slow_node_is_named_within_the_window(world):
    w, etcd, agents = world
    job = "strag-named"
    slow_file = os.path.join(w.shared, "slow-now")
    agents += [start(w, etcd, h, job) for h in w.hosts[:2]]
    agents.append(start(w, etcd, w.hosts[2], job,
                        env={"WORKER_SLOW_MS": str(SLOW_MS), "WORKER_SLOW_FILE": slow_file}))
    cluster.wait_for_world(agents, 3, 0.0, timeout=300, live=agents)
    slow_id = node_id(agents[2])

    # Equal nodes for a whole window, its summaries and judgements: nobody is named.
    time.sleep(WINDOW + 2 * PERIOD)
    assert named_lines(agents, job) == [], named_lines(agents, job)
    assert "STRAGGLER" not in status(etcd, job)
    for h in w.hosts:
        assert metric(h, "efdl_straggler") == {
            '{efdl_job="%s",efdl_node="%s"}' % (job, node_id(a)): 0.0
            for a in agents if a.name == h.name}
    equal = {h.name: metric(h, "efdl_rank_compute_seconds") for h in w.hosts}
    print("compute seconds per step, equal nodes: %s" % equal)

    # One node slows down: named by the judge within the window, a period for its summaries
    # to be read and half a period for the judge's phase.
    open(slow_file, "w").close()
    slowed = time.monotonic()
    bound = WINDOW + 1.5 * PERIOD + 5
    cluster.wait_for(lambda: named_lines(agents, job), bound + 30, "the straggler named")
    took = time.monotonic() - slowed
    lines = named_lines(agents, job)
    print("named after %.1f s (bound %.0f s): %s" % (took, bound, lines))
    assert took <= bound, (took, lines)
    assert len(lines) == 1, lines
    m = re.search(r"node (\S+) is a straggler: rank (\d+) ([\d.]+) s of compute per step, "
                  r"([\d.]+)x the median ([\d.]+) s", lines[0])
    assert m and m.group(1) == slow_id, lines
    assert float(m.group(4)) >= 2.0, lines
    text = status(etcd, job)
    assert re.search(r"%s is a STRAGGLER in round \d+ since \S+: rank %s " % (
        re.escape(slow_id), m.group(2)), text), text
    row = re.search(r'<tr data-trouble="%s">(.*?)</tr>' % re.escape(slow_id), page_dom(etcd, job))
    assert row and "straggler" in row.group(1) and "rank %s: " % m.group(2) in row.group(1), (
        row.group(0) if row else "no row of the straggler on the page")
    cluster.wait_for(lambda: list(metric(w.hosts[2], "efdl_straggler").values()) == [1.0],
                     2 * PERIOD + 5, "efdl_straggler 1 on the slow node")
    compute = metric(w.hosts[2], "efdl_rank_compute_seconds")
    assert list(compute.values())[0] >= SLOW_MS / 1000.0, compute
    for h in w.hosts[:2]:
        assert list(metric(h, "efdl_straggler").values()) == [0.0]
    # Named, not evicted: the job still runs at world size 3.
    assert "evicted" not in agents[2].output()
    cluster.wait_for_world(agents, 3, time.monotonic(), timeout=30, live=agents)


def test_evict_stragglers_removes_the_slow_node_and_throughput_rises(world):
    w, etcd, agents = world
    job = "strag-evict"
    extra = ["--evict-stragglers", "--straggler-window", "%g" % SHORT_WINDOW]
    agents += [start(w, etcd, h, job, extra=extra) for h in w.hosts[:2]]
    agents.append(start(w, etcd, w.hosts[2], job, extra=extra,
                        env={"WORKER_SLOW_MS": str(SLOW_MS)}))
    cluster.wait_for_world(agents, 3, 0.0, timeout=300, live=agents)
    formed = time.monotonic()
    slow_id = node_id(agents[2])
    cluster.wait_for(lambda: "is evicted from job '%s'" % job in agents[2].output(), 90,
                     "the straggler evicted")
    evicted = time.monotonic()
    assert re.search(r"node %s is a straggler: rank \d+" % re.escape(slow_id),
                     "\n".join(named_lines(agents, job))), named_lines(agents, job)
    before = throughput(agents, 3, formed, evicted)
    cluster.wait_for_world(agents[:2], 2, evicted, timeout=60, live=agents[:2])
    resumed = time.monotonic()
    time.sleep(5)   # about 40 steps at world 2
    after = throughput(agents, 2, resumed, time.monotonic())
    print("throughput: %.0f samples/s with the straggler (world 3), %.0f samples/s after its "
          "eviction (world 2): %.2fx" % (before, after, after / before))
    assert after > 1.3 * before, (before, after)
    text = status(etcd, job)
    assert re.search(r"%s EXCLUDED at \S+ until \S+ \(a straggler, --evict-stragglers; "
                     r"exclusion 1\)" % re.escape(slow_id), text), text
    assert "evicted" in agents[2].output() and agents[2].proc.poll() is None


def test_a_straggler_the_job_cannot_go_on_without_stays(world):
    """--evict-stragglers only while MIN other nodes remain: at --nnodes 2:2 the named node says
    so once and the job goes on with it."""
    w, etcd, agents = world
    job = "strag-min"
    extra = ["--evict-stragglers", "--straggler-window", "%g" % SHORT_WINDOW]
    agents.append(start(w, etcd, w.hosts[0], job, extra=extra, nnodes="2:2"))
    agents.append(start(w, etcd, w.hosts[1], job, extra=extra, nnodes="2:2",
                        env={"WORKER_SLOW_MS": str(SLOW_MS)}))
    cluster.wait_for_world(agents, 2, 0.0, timeout=300, live=agents)
    cluster.wait_for(lambda: "but the job cannot go on without it" in agents[1].output(), 60,
                     "the straggler saying it stays")
    line = [x for x in agents[1].output().splitlines() if "cannot go on without it" in x]
    print(line)
    assert len(line) == 1 and "(1 other node(s), --nnodes MIN 2): it stays" in line[0], line
    assert "evicted" not in agents[1].output()
    cluster.wait_for_world(agents, 2, time.monotonic(), timeout=30, live=agents)
