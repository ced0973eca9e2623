"""The agents' Prometheus metrics (issue #33, docs/operations.md "Metrics"), scraped by a real
Prometheus server (Debian's `prometheus`) through a crash.

Three hosts (tests/python/workers/hosts.py: each agent in its own network namespace, so each
serves on the default port 9441 of its own address) run a State program with default flags.
The targets come from etcd (`efdl status --prometheus-targets`) into a file_sd file of the scrape
config in deploy/prometheus, which the test runs as written but for a 1 s scrape interval and
the file's place. One host dies as a whole; the test asks Prometheus' HTTP API (PromQL) and
finds the world size drop from 3 to 2, the crash counted by both survivors, the pause they
observed, and the dead target down; then runs every query of the Grafana dashboard in
deploy/grafana (Prometheus accepts each; the panels that need no event show data).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))

import cluster  # noqa: E402
import hosts  # noqa: E402

STATE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                            "state_worker.py")
DEPLOY_CONFIG = os.path.join(cluster.REPO, "deploy", "prometheus", "prometheus.yml")
GRAFANA = os.path.join(cluster.REPO, "deploy", "grafana", "efdl-dashboard.json")

_why = (hosts.HostWorld.unavailable()
        or (None if cluster.efdl_bin() else "efdl is not built")
        or (None if shutil.which("prometheus") else "no prometheus server (apt: prometheus)"))
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))

world = pytest.fixture(cluster.host_world)


class Prometheus:
    """A real Prometheus on a free loopback port with deploy/prometheus/prometheus.yml, its
    file_sd files in `dir`/targets and its data in `dir`/data; close() stops it."""

    def __init__(self, dir):
        import yaml
        self.dir = dir
        self.targets = os.path.join(dir, "targets")
        os.makedirs(self.targets)
        config = yaml.safe_load(open(DEPLOY_CONFIG))
        config["global"]["scrape_interval"] = "1s"
        config["global"]["scrape_timeout"] = "1s"
        sd = config["scrape_configs"][0]["file_sd_configs"][0]
        assert sd["files"] == ["/etc/prometheus/efdl/*.json"], sd
        sd["files"] = [os.path.join(self.targets, "*.json")]
        path = os.path.join(dir, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.address = "127.0.0.1:%d" % cluster.free_port()
        self.log = os.path.join(dir, "prometheus.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                ["prometheus", "--config.file", path,
                 "--storage.tsdb.path", os.path.join(dir, "data"),
                 "--web.listen-address", self.address],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        cluster.wait_for(self._ready, 60, "prometheus to become ready", output=self._log_tail)

    def _log_tail(self):
        return open(self.log).read()[-3000:]

    def _ready(self):
        if self.proc.poll() is not None:
            raise AssertionError("prometheus exited %s:\n%s" % (self.proc.poll(),
                                                                 self._log_tail()))
        try:
            with urllib.request.urlopen("http://%s/-/ready" % self.address, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def set_targets(self, name, text):
        tmp = os.path.join(self.targets, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.rename(tmp, os.path.join(self.targets, name + ".json"))

    def query(self, promql):
        """The instant vector of `promql`: [(labels, float value)]."""
        url = "http://%s/api/v1/query?%s" % (self.address,
                                             urllib.parse.urlencode({"query": promql}))
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def status_targets(etcd, job):
    out = subprocess.run([cluster.efdl_bin(), "status", "--etcd", etcd.endpoint, "--job", job,
                          "--prometheus-targets"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def by_node(series):
    return {labels.get("efdl_node"): value for labels, value in series}


def test_a_real_prometheus_scrapes_three_hosts_through_a_crash(world):
    w, etcd, agents = world
    job = "metrics"
    env = {"WORKER_EPOCHS": "1000", "WORKER_STEP_TIME": "0.1"}
    agents += [cluster.start_host_agent(w, etcd, h, job, env=env,
                                     command=[cluster.PYTHON, STATE_WORKER]) for h in w.hosts]
    cluster.wait_for_world(agents, 3, 0.0, timeout=300, live=agents)

    # Every node announced its endpoint: the default port on its own address.
    groups = json.loads(status_targets(etcd, job))
    assert len(groups) == 1 and groups[0]["labels"] == {"efdl_job": job}, groups
    assert sorted(groups[0]["targets"]) == sorted("%s:9441" % h.addr for h in w.hosts), groups
    text = subprocess.run([cluster.efdl_bin(), "status", "--etcd", etcd.endpoint, "--job", job],
                          capture_output=True, text=True, timeout=30).stdout
    for h in w.hosts:
        assert "serves metrics at http://%s:9441/metrics" % h.addr in text, text

    prom = Prometheus(os.path.join(w.dir, "prometheus"))
    try:
        prom.set_targets(job, status_targets(etcd, job))

        def world_sizes():
            return by_node(prom.query('efdl_world_size{efdl_job="%s"}' % job))

        cluster.wait_for(lambda: sorted(world_sizes().values()) == [3, 3, 3], 60,
                         "prometheus to scrape world size 3 from the three nodes",
                         output=lambda: "%s\n%s" % (world_sizes(), prom._log_tail()), interval=0.5)
        steps = prom.query('efdl_rank_step{efdl_job="%s"}' % job)
        assert sorted(labels["rank"] for labels, _ in steps) == ["0", "1", "2"], steps
        assert all(v >= 0 for _, v in steps), steps

        lost = w.hosts[2]
        killed_at = time.monotonic()
        lost.kill()
        cluster.wait_for_world(agents[:2], 2, killed_at, timeout=120, live=agents[:2])
        survivors = [a.name for a in agents[:2]]
        node_of = {}
        for a in agents:
            for line in a.output().splitlines():
                if " joined job " in line:
                    node_of[a.name] = line.split(" node ", 1)[1].split()[0]

        def after_crash():
            sizes = world_sizes()
            pauses = by_node(prom.query(
                'efdl_pause_seconds_count{efdl_job="%s",phase="rendezvous"}' % job))
            return (sorted(sizes.get(node_of[n]) or 0 for n in survivors) == [2, 2]
                    and all(pauses.get(node_of[n], 0) >= 1 for n in survivors))

        cluster.wait_for(after_crash, 60, "prometheus to see the survivors at world size 2",
                         output=lambda: "%s %s\n%s" % (world_sizes(), node_of,
                                                       cluster.outputs(agents)), interval=0.5)
        # The drop, over the window that holds both rounds.
        peak = by_node(prom.query('max_over_time(efdl_world_size{efdl_job="%s"}[10m])' % job))
        assert all(peak[node_of[n]] == 3 for n in survivors), peak
        # Each survivor counted the crash as a round change that was not orderly...
        crashes = by_node(prom.query(
            'efdl_round_changes_total{efdl_job="%s",graceful="false"}' % job))
        assert all(crashes.get(node_of[n], 0) >= 1 for n in survivors), crashes
        # ... and observed its pause: the rendezvous, then its workers' first progress again.
        resumed = by_node(prom.query(
            'efdl_pause_seconds_count{efdl_job="%s",phase=~"resume|rendezvous"}' % job))
        assert all(resumed.get(node_of[n], 0) >= 1 for n in survivors), resumed
        longest = prom.query('max(efdl_pause_seconds_sum{efdl_job="%s",phase="rendezvous"})'
                             % job)
        assert longest and 0 < longest[0][1] < 60, longest
        # The dead node's target is down; the others are up.
        up = {labels["instance"]: v for labels, v in prom.query('up{job="efdl"}')}
        assert up["%s:9441" % lost.addr] == 0, up
        assert sorted(v for i, v in up.items() if i != "%s:9441" % lost.addr) == [1, 1], up
        # The survivors' restart counters: a crash of another node is nobody's restart here.
        restarts = by_node(prom.query('efdl_restarts_total{efdl_job="%s"}' % job))
        assert all(restarts[node_of[n]] == 0 for n in survivors), restarts
        # Every query of the Grafana dashboard in deploy/ runs on this Prometheus, and the
        # panels that need no event of their own show data.
        panels = json.load(open(GRAFANA))["panels"]
        must_show = {"World size and nodes", "Round", "Training throughput (steps/s per rank)",
                     "Seconds per step by rank", "Snapshot age", "Scrape targets up",
                     "Restarts counted and fencing", "Progress age by rank",
                     "etcd requests (p95 latency, errors)", "Goodput",
                     "Job wall time by category", "Compute time per step by rank",
                     "Stragglers"}
        assert must_show <= {p["title"] for p in panels}, [p["title"] for p in panels]

        def empty_panels():
            """Titles of the panels none of whose queries has data now."""
            empty = []
            for panel in panels:
                shown = [prom.query(t["expr"].replace("$job", job))   # (each must be accepted)
                         for t in panel["targets"]]
                if not any(shown):
                    empty.append(panel["title"])
            return empty

        # (the new round's ranks report again within a few scrapes)
        cluster.wait_for(lambda: not must_show & set(empty_panels()), 30,
                         "the dashboard's panels to show data",
                         output=lambda: "empty: %s" % empty_panels(), interval=1)
        # The targets follow the job: the dead node is gone from the list.
        cluster.wait_for(lambda: "%s:9441" % lost.addr not in status_targets(etcd, job), 60,
                         "the dead node's target to leave efdl status --prometheus-targets", interval=0.5)
    finally:
        prom.close()
