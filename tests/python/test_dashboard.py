"""`efdl dashboard` (issue #33, docs/operations.md "Dashboard"): its page in a real headless
Chromium (Debian's `chromium`) during a real job through a kill.

A real etcd and three real agents (workers/state_worker.py, each agent's metrics on a free port)
train; `efdl dashboard` serves the page on a free loopback port. Chromium loads the page, lets
it poll the dashboard's JSON document, and dumps the DOM: it shows the three nodes as members,
world size 3, and a throughput read from the nodes' metrics. One agent is SIGKILLed with its
workers; once the survivors train in the new round, the DOM shows world size 2 and the round
change among the events and on the chart, and - once both survivors wrote their part of the
goodput ledger (`efdl events --json` shows the crash) - the goodput as a percentage, its
categories, and the ledger's crash row with the same phases; still so after every agent is gone
(the ledger stays in etcd). A screenshot is taken too (kept in docs/images when
EFDL_DASHBOARD_SCREENSHOT names the file). The dashboard stops on SIGTERM with exit 0, after it
showed the job's last state once every agent was gone.
"""

import json
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

STATE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                            "state_worker.py")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

_why = ((None if cluster.efdl_bin() else "efdl is not built")
        or (None if CHROMIUM else "no headless browser (apt: chromium; scripts/install-deps)"))
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))


class Browser:
    """Headless Chromium runs, each in its own process group, with a profile, cache, HOME and
    shared memory files under `dir` (removed by the caller)."""

    def __init__(self, dir):
        self.dir = dir
        self.env = dict(os.environ, HOME=dir, TMPDIR=dir, XDG_CONFIG_HOME=dir,
                        XDG_CACHE_HOME=dir)

    def run(self, url, *extra, budget_ms=4000, timeout=60):
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                "--user-data-dir=" + os.path.join(self.dir, "profile"),
                "--virtual-time-budget=%d" % budget_ms] + list(extra) + [url]
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, encoding="utf-8",
                                errors="replace", start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # its helpers, whatever the outcome
            except ProcessLookupError:
                pass
            proc.wait()
        assert proc.returncode == 0, "chromium exited %s:\n%s" % (proc.returncode, err[-3000:])
        return out

    def dom(self, url):
        return self.run(url, "--dump-dom")


def text_of(dom, element_id):
    m = re.search(r'id="%s"[^>]*>([^<]*)<' % re.escape(element_id), dom)
    return m.group(1) if m else None


def page(dom):
    """The rendered part of a dumped DOM (without the page's script), for failure messages."""
    return dom.split("<script", 1)[0][-4000:]


def node_states(dom):
    """{node: state} of the page's node table rows."""
    return dict(re.findall(r'<tr data-node="([^"]+)" data-state="([^"]+)"', dom))


def state_doc(url):
    with urllib.request.urlopen(url + "api/state", timeout=5) as r:
        return json.load(r)


def wait_training(url, ranks, polls=6):
    """Waits until the dashboard's last `polls` throughput points read `ranks` ranks training."""
    def training():
        last = state_doc(url)["throughput"][-polls:]
        return len(last) == polls and all(p[3] == ranks and p[1] > 0 for p in last)
    cluster.wait_for(training, 40, "the dashboard to read %d ranks training" % ranks,
                     output=lambda: json.dumps(state_doc(url))[-3000:], interval=0.25)


def efdl_events(job):
    r = subprocess.run([cluster.efdl_bin(), "events", "--etcd", job.endpoint, "--job", job.job,
                        "--json"], capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr if r.returncode else r.stdout


def ledger_crash(job, nodes):
    """The crash event of `efdl events --json` once `nodes` all wrote their part of it."""
    try:
        report = json.loads(efdl_events(job))
    except ValueError:
        return None
    crashes = [e for e in report["events"] if e["kind"] == "crash" and e["nodes"] == nodes]
    return crashes[-1] if crashes else None


def check_ledger(dom, crash):
    """The page shows the ledger: goodput as a percentage, its categories as a bar and a legend,
    and the crash `efdl events` reported as a row of the events table with the same phases."""
    gp = text_of(dom, "goodput")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", gp or "")
    assert m and 0 < float(m.group(1)) < 100, "goodput %r\n%s" % (gp, page(dom))
    assert "wall time since" in (text_of(dom, "goodput-wall") or ""), page(dom)
    bar = dom.split('id="gp-bar"', 1)[1].split("</section>", 1)[0]
    segments = dict(re.findall(r'<div data-category="(\w+)" data-seconds="([\d.e+-]+)"', bar))
    assert float(segments.get("training", 0)) > 0, bar
    legend = dom.split('id="gp-legend"', 1)[1].split("</section>", 1)[0]
    assert set(re.findall(r'<div data-category="(\w+)"', legend)) == {
        "training", "lost", "startup", "rendezvous", "waiting", "restore", "hung", "suspended"}, legend
    row = re.search(r'<tr data-ledger-kind="crash" data-round="%d">(.*?)</tr>' % crash["round"],
                    dom)
    assert row, page(dom)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))
    assert cells[1:4] == [str(crash["round"]), "crash", "%d → %d" % (
        crash["world_before"], crash["world_after"])], cells
    # Seconds with two decimals (JavaScript's toFixed may round a tie the other way).
    for cell, key in zip(cells[4:10], ("pause_s", "detection_s", "waiting_s", "rendezvous_s",
                                       "restore_s", "first_step_s")):
        assert abs(float(cell) - crash[key]) <= 0.006, (key, cells, crash)
    assert cells[10] == str(crash["steps_lost"]), (cells, crash)


@pytest.fixture
def job():
    with cluster.running("dash-%d" % os.getpid()) as c:
        yield c


def test_the_page_shows_a_job_live_through_a_kill(job, tmp_path):
    env = {"WORKER_EPOCHS": "1000", "WORKER_STEP_TIME": "0.1"}
    agents = [job.start_agent("node-%d" % i, env=env, command=[cluster.PYTHON, STATE_WORKER],
                              extra=["--metrics-port", "0"]) for i in range(3)]
    job.wait_for_world(3, timeout=120)

    browser_dir = tempfile.mkdtemp(prefix="efdl-dash-chromium-")
    dash = subprocess.Popen([cluster.efdl_bin(), "dashboard", "--etcd", job.endpoint, "--job",
                             job.job, "--port", str(cluster.free_port()), "--poll", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        first = dash.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+/) ", first)
        assert m, "no URL in the dashboard's first line: %r %s" % (first, dash.stderr.read()
                                                                   if dash.poll() else "")
        url = m.group(1)
        browser = Browser(browser_dir)

        # The dashboard has read the throughput of all three ranks for a few polls.
        wait_training(url, 3)
        dom = browser.dom(url)
        assert text_of(dom, "world-size") == "3", page(dom)
        assert text_of(dom, "job-state") == "running", page(dom)
        assert node_states(dom) == {a.name: "member" for a in agents}, page(dom)
        assert float(text_of(dom, "sum-rate")) > 0, page(dom)
        assert "<path" in dom, "the chart draws the throughput"
        round_before = int(text_of(dom, "round"))

        # A node dies with its workers; the survivors form a round of two and train.
        victim = agents[2]
        killed_at = time.monotonic()
        victim.kill()
        job.wait_for_world(2, since=killed_at, agents=agents[:2], timeout=90)
        cluster.wait_for(lambda: (lambda s: s["world_size"] == 2 and s["phase"] == "active")(
            state_doc(url)["status"]), 30, "the dashboard to read world size 2",
            output=lambda: json.dumps(state_doc(url)["status"])[-3000:], interval=0.25)
        # The goodput ledger records the crash once every local rank of each survivor reported
        # progress in the new round (`efdl events` reads it from etcd); the dashboard reads the
        # same ledger each poll.
        crash = cluster.wait_for(lambda: ledger_crash(job, ["node-0", "node-1"]), 60,
                                 "the ledger's crash event written by both survivors",
                                 output=lambda: efdl_events(job)[-3000:], interval=0.25)
        assert (crash["world_before"], crash["world_after"]) == (3, 2), crash
        cluster.wait_for(lambda: any(
            e["round"] == crash["round"] and e["nodes"] == crash["nodes"]
            for e in (state_doc(url)["ledger"] or {"events": []})["events"]), 20,
            "the dashboard to read the ledger's crash event",
            output=lambda: json.dumps(state_doc(url)["ledger"])[-3000:], interval=0.25)
        dom = browser.dom(url)
        assert text_of(dom, "world-size") == "2", page(dom)
        assert int(text_of(dom, "round")) > round_before, page(dom)
        check_ledger(dom, crash)
        states = node_states(dom)
        assert states.get("node-0") == "member" and states.get("node-1") == "member", states
        assert states.get(victim.name) in (None, "gone", "waiting"), states
        # The round change: in the event list, and drawn on the chart.
        changes = re.findall(r'<li data-kind="round">.*?</li>', dom)
        assert any("world size 2" in c for c in changes), page(dom)
        assert 'data-kind="round"' in dom.split('id="chart"', 1)[1].split("</svg>", 1)[0]
        # The status record's events are there too (the coordinator's own lines).
        assert re.search(r'<li data-kind="event">.*?round \d+', dom), page(dom)

        # The survivors' throughput, read again in the new round.
        wait_training(url, 2)
        shot = os.path.join(browser_dir, "dashboard.png")
        browser.run(url, "--screenshot=" + shot, "--window-size=1280,900", "--hide-scrollbars")
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("EFDL_DASHBOARD_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["EFDL_DASHBOARD_SCREENSHOT"])

        # Every agent gone: the page still shows the job's last state from etcd.
        for a in agents[:2]:
            a.kill()
        doc = state_doc(url)
        assert doc["status"]["exists"] and doc["status"]["round"] >= round_before + 1, doc
        dom = browser.dom(url)
        assert text_of(dom, "round") == str(doc["status"]["round"]), page(dom)
        # The ledger stays in etcd: goodput and the crash are still shown.
        check_ledger(dom, crash)

        dash.send_signal(signal.SIGTERM)
        assert dash.wait(timeout=20) == 0, dash.stderr.read()
        assert "stopping" in dash.stderr.read()
    finally:
        if dash.poll() is None:
            os.killpg(dash.pid, signal.SIGKILL)
            dash.wait()
        dash.stdout.close()
        dash.stderr.close()
        shutil.rmtree(browser_dir, ignore_errors=True)


def test_bad_input_is_one_line(job):
    def run(*args):
        return subprocess.run([cluster.efdl_bin(), "dashboard"] + list(args),
                              capture_output=True, text=True, timeout=30)

    r = run("--etcd", job.endpoint, "--job", "a/b")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "job id" in r.stderr, r.stderr
    r = run("--job", "x")
    assert r.returncode == 2 and "--etcd HOST:PORT is required" in r.stderr, r.stderr
    r = run("--etcd", job.endpoint, "--job", "x", "--port", "70000")
    assert r.returncode == 2 and "--port 70000 is not a port" in r.stderr, r.stderr
    r = run("--etcd", job.endpoint, "--job", "x", "--bind", "localhost")
    assert r.returncode == 2 and "--bind 'localhost' is not a numeric IPv4 address" in r.stderr
    r = run("--etcd", "127.0.0.1:%d" % cluster.free_port(), "--job", "x")
    assert r.returncode == 1 and "cannot reach etcd" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    # A port in use (etcd's own): one line, exit 1.
    r = run("--etcd", job.endpoint, "--job", "x", "--port", job.endpoint.rsplit(":", 1)[1])
    assert r.returncode == 1 and "cannot listen on 127.0.0.1:" in r.stderr, r.stderr
    assert "the port is taken" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
