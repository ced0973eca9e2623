"""The Kubernetes manifests in deploy/k8s (issue #36), checked as far as possible without a
cluster:

- every document of the manifests, as they are and rendered by deploy/k8s/render.py with several
  parameter sets, validates against the Kubernetes API's OpenAPI schema (the npm package
  kubernetes-models, installed by scripts/install-deps into deploy/k8s/validate), and a broken
  one does not;
- the fields that tie them together: a Job (not a Deployment) whose completion ends it, the pod
  failure policy (graceful leaves and disruptions not counted, real failures counted), etcd as
  a StatefulSet of the upstream etcd image, the etcd Service and ports the job names, node
  identity from the downward API, the grace period against the agent's stop sequence, the
  snapshot volume and a memory-backed /dev/shm;
- the pod's start script (the ConfigMap's start.sh) run on simulated hosts
  (tests/python/workers/hosts.py) with the environment the pod spec gives (the downward-API
  values of each host), against a 3-member etcd of which one member never starts: it waits while
  only one member is up, starts `efdl run` once two are (a majority), and the job trains and
  completes.

Not covered (no cluster here): the Job controller, the kubelet, DNS, the scheduler, the image.
"""

import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))

import cluster  # noqa: E402
import hosts  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S_DIR = os.path.join(REPO, "deploy", "k8s")
sys.path.insert(0, K8S_DIR)
import render  # noqa: E402

VALIDATE = os.path.join(K8S_DIR, "validate")
PARAMETER_SETS = [
    {},
    {"image": "registry.example.com/efdl:0.2", "job_id": "digits-2", "nodes": 4,
     "nnodes": "2:8"},
    {"job_id": "big", "nodes": 1, "nnodes": "1:1", "etcd": "etcd-a:2379,etcd-b:2379",
     "with_etcd": False, "shm": "16Gi"},
    {"nodes": 3, "command": ["/usr/bin/python3", "/workspace/train.py", "--epochs", "3"]},
]


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def trainer_of(docs):
    (job,) = of_kind(docs, "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return job, c


def env_values(container):
    """{name: value or ('fieldRef', path)} of a container's env."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            out[e["name"]] = ("fieldRef", e["valueFrom"]["fieldRef"]["fieldPath"])
    return out


# -- schema ----------------------------------------------------------------------------------

def validator_missing():
    if shutil.which("node") is None:
        return "node (Node.js) is not installed"
    if not os.path.isdir(os.path.join(VALIDATE, "node_modules", "kubernetes-models")):
        return ("deploy/k8s/validate/node_modules is missing: scripts/install-deps runs "
                "`npm ci` there")
    return None


def validate(docs):
    proc = subprocess.run(["node", os.path.join(VALIDATE, "validate.mjs")],
                          input=json.dumps(docs), capture_output=True, text=True, timeout=60,
                          cwd=VALIDATE)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.skipif(validator_missing() is not None, reason=str(validator_missing()))
@pytest.mark.parametrize("params", PARAMETER_SETS, ids=lambda p: ",".join(sorted(p)) or "as-is")
def test_manifests_validate_against_the_kubernetes_api_schema(params):
    docs = render.render(**params)
    code, out = validate(docs)
    assert code == 0, out
    assert out.count("\nok ") + out.startswith("ok ") == len(docs), out


@pytest.mark.skipif(validator_missing() is not None, reason=str(validator_missing()))
def test_the_schema_check_rejects_a_broken_job():
    docs = render.render()
    job, trainer = trainer_of(docs)
    job["spec"]["parallelism"] = "two"
    job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["operator"] = 7
    del trainer["name"]
    code, out = validate(docs)
    assert code == 1, out
    assert "invalid Job efdl-digits" in out and "parallelism" in out, out


# -- what ties them together, on every rendered set -----------------------------------------

@pytest.mark.parametrize("params", PARAMETER_SETS, ids=lambda p: ",".join(sorted(p)) or "as-is")
def test_rendered_manifests_hold_together(params):
    docs = render.render(**params)
    for d in docs:
        name = d["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name), name
    job, trainer = trainer_of(docs)
    env = env_values(trainer)
    pod = job["spec"]["template"]["spec"]

    # A Job whose completion ends it: no completions (a pod's success, every agent exiting 0
    # when training completes, completes the Job), pods never restarted in place.
    assert job["apiVersion"] == "batch/v1"
    assert "completions" not in job["spec"] and "completionMode" not in job["spec"]
    assert pod["restartPolicy"] == "Never"
    lo, hi = (int(x) for x in env["EFDL_NNODES"].split(":"))
    assert 1 <= lo <= job["spec"]["parallelism"] or params.get("nodes") == 1
    assert lo <= hi

    # Failure policy: SIGTERM/SIGINT leaves (143/130) and disruptions are ignored; exit 1 (a
    # node gave up), 2 (bad input) and crashes count against backoffLimit.
    rules = job["spec"]["podFailurePolicy"]["rules"]
    ignored = {v for r in rules if r["action"] == "Ignore" and "onExitCodes" in r
               for v in r["onExitCodes"]["values"] if r["onExitCodes"]["operator"] == "In"}
    assert ignored == {130, 143}, rules
    assert any(r["action"] == "Ignore" and any(c["type"] == "DisruptionTarget"
                                               for c in r.get("onPodConditions", []))
               for r in rules), rules
    assert all(r["onExitCodes"]["containerName"] == trainer["name"]
               for r in rules if "onExitCodes" in r)
    assert job["spec"]["backoffLimit"] >= 1

    # Node identity from the downward API; settings from EFDL_* variables efdl run reads.
    assert env["EFDL_NODE_ID"] == ("fieldRef", "metadata.name")
    assert env["EFDL_ADVERTISE_ADDR"] == ("fieldRef", "status.podIP")
    assert env["EFDL_JOB_ID"] == params.get("job_id", "digits")
    assert job["metadata"]["name"] == "efdl-" + env["EFDL_JOB_ID"]
    if "image" in params:
        assert trainer["image"] == params["image"]
    # The grace period covers the agent's stop sequence: a stop request, SIGTERM after
    # EFDL_STOP_GRACE, SIGKILL after another.
    assert pod["terminationGracePeriodSeconds"] > 2 * float(env["EFDL_STOP_GRACE"])

    # The start script comes from the job's ConfigMap; the command after it is the training.
    (cm,) = of_kind(docs, "ConfigMap")
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert trainer["command"] == ["/bin/sh", "/etc/efdl/start.sh"]
    assert volumes[mounts["/etc/efdl"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert "exec efdl run -- \"$@\"" in cm["data"]["start.sh"]
    assert trainer["args"] == params.get("command", trainer["args"])
    # No init container requiring every etcd member (the quorum wait is in start.sh).
    assert "initContainers" not in pod

    # Snapshots on a shared volume; /dev/shm memory-backed.
    claim = volumes[mounts[env["EFDL_SNAPSHOT_DIR"]]]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [p for p in of_kind(docs, "PersistentVolumeClaim")
              if p["metadata"]["name"] == claim]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    if "shm" in params:
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"] == params["shm"]

    # etcd: the job names the etcd Service's members and client port, or the given cluster.
    endpoints = env["EFDL_ETCD_ENDPOINTS"].split(",")
    if params.get("with_etcd", True) is False:
        assert not of_kind(docs, "StatefulSet")
        assert endpoints == params["etcd"].split(",")
        return
    (sts,) = of_kind(docs, "StatefulSet")
    (svc,) = [s for s in of_kind(docs, "Service")
              if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None"
    client_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
    assert len(endpoints) == sts["spec"]["replicas"] == 3
    for i, ep in enumerate(endpoints):
        assert ep == "%s-%d.%s:%d" % (sts["metadata"]["name"], i, svc["metadata"]["name"],
                                      client_port)
    # etcd does not need the training image, and admits the job's pods.
    (etcd_c,) = sts["spec"]["template"]["spec"]["containers"]
    assert etcd_c["image"] != trainer["image"] and "etcd" in etcd_c["image"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    (netpol,) = of_kind(docs, "NetworkPolicy")
    client_labels = [p["podSelector"]["matchLabels"] for rule in netpol["spec"]["ingress"]
                     for p in rule["from"]]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert any(all(pod_labels.get(k) == v for k, v in sel.items()) for sel in client_labels)


def test_the_pods_announce_the_agents_metrics_port():
    """Prometheus finds each pod's agent: the port `efdl run` serves metrics on by default (its
    --help says it, from src/metrics), named in the container and the pod's annotations."""
    help_text = subprocess.run([cluster.efdl_bin(), "run", "--help"], capture_output=True,
                               text=True, timeout=30).stdout
    default = re.search(r"auto: (\d+), or the next free port", help_text)
    assert default, help_text
    job, trainer = trainer_of(render.render())
    (port,) = [p for p in trainer.get("ports", []) if p["name"] == "metrics"]
    assert port["containerPort"] == int(default.group(1)), port
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == default.group(1)
    assert "EFDL_METRICS_PORT" not in env_values(trainer)   # the default: auto


def test_etcd_members_and_header():
    docs = render.render()
    (sts,) = of_kind(docs, "StatefulSet")
    (etcd_c,) = sts["spec"]["template"]["spec"]["containers"]
    args = dict(a[2:].split("=", 1) for a in etcd_c["args"])
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    assert sorted(members) == ["efdl-etcd-%d" % i for i in range(3)]
    with open(os.path.join(K8S_DIR, "etcd.yaml")) as f:
        header = f.read().split("apiVersion")[0]
    # EFDL's client has TLS and auth: the header must not say otherwise.
    assert "does not speak TLS" not in header and "EFDL_ETCD_CACERT" in header, header


def test_render_refuses_a_job_id_kubernetes_cannot_name():
    proc = subprocess.run([sys.executable, os.path.join(K8S_DIR, "render.py"), "--job",
                           "Digits_2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--job 'Digits_2'" in proc.stderr, proc.stderr
    out = subprocess.run([sys.executable, os.path.join(K8S_DIR, "render.py"), "--nodes", "3"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert [d["spec"]["parallelism"] for d in yaml.safe_load_all(out)
            if d and d["kind"] == "Job"] == [3]


# -- the pod's start script on simulated hosts ----------------------------------------------

_hosts_why = hosts.HostWorld.unavailable() or (None if cluster.efdl_bin() else
                                               "efdl is not built")
_hosts_why = _hosts_why or (None if shutil.which("etcdctl") else "etcdctl is not installed")


class EtcdMember:
    """One member of a 3-member etcd cluster on the world's bridge."""

    def __init__(self, world, name, client, peer, initial):
        self.world, self.name, self.client, self.peer = world, name, client, peer
        self.endpoint = "%s:%d" % (world.bridge_addr, client)
        self.initial = initial
        self.proc = None

    def start(self):
        addr = self.world.bridge_addr
        log = open(os.path.join(self.world.dir, "%s.log" % self.name), "w")
        self.proc = subprocess.Popen(
            ["etcd", "--name", self.name, "--data-dir",
             os.path.join(self.world.dir, "etcd-" + self.name),
             "--listen-client-urls", "http://%s:%d" % (addr, self.client),
             "--advertise-client-urls", "http://%s:%d" % (addr, self.client),
             "--listen-peer-urls", "http://%s:%d" % (addr, self.peer),
             "--initial-advertise-peer-urls", "http://%s:%d" % (addr, self.peer),
             "--initial-cluster", self.initial, "--initial-cluster-state", "new",
             "--initial-cluster-token", "efdl-k8s-test"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)


def pod_env(trainer, host, pod_name, overrides):
    """The environment the kubelet gives the trainer container on `host`: its env entries with
    the downward-API fields resolved (metadata.name -> the pod name, status.podIP -> the host's
    address), HOSTNAME = the pod name, and `overrides` (paths of this machine)."""
    env = cluster.base_env()
    env["PATH"] = os.path.dirname(cluster.efdl_bin()) + os.pathsep + env["PATH"]
    for name, value in env_values(trainer).items():
        if isinstance(value, tuple):
            value = {"metadata.name": pod_name, "status.podIP": host.addr}[value[1]]
        env[name] = value
    env["HOSTNAME"] = pod_name
    env.update(overrides)
    return env


@pytest.mark.skipif(_hosts_why is not None, reason=str(_hosts_why))
def test_pod_start_script_waits_for_an_etcd_majority_then_trains_to_completion():
    world = hosts.HostWorld(2)
    members, pods = [], []
    try:
        ports = [(cluster.free_port(), cluster.free_port()) for _ in range(3)]
        initial = ",".join("m%d=http://%s:%d" % (i, world.bridge_addr, p)
                           for i, (_, p) in enumerate(ports))
        members = [EtcdMember(world, "m%d" % i, c, p, initial) for i, (c, p) in enumerate(ports)]
        endpoints = ",".join(m.endpoint for m in members)
        docs = render.render(etcd=endpoints, nodes=2, nnodes="2:2", command=[
            cluster.PYTHON, os.path.join(REPO, "examples", "train_ddp_state.py"),
            "--epochs", "1", "--log-interval", "5", "--step-delay", "0.02"])
        job, trainer = trainer_of(docs)
        (cm,) = of_kind(docs, "ConfigMap")
        start_sh = os.path.join(world.shared, "start.sh")     # the ConfigMap's mount
        with open(start_sh, "w") as f:
            f.write(cm["data"]["start.sh"])
        snapshots = os.path.join(world.shared, "snapshots")   # the PVC's mount
        overrides = {"EFDL_SNAPSHOT_DIR": snapshots, "EFDL_LOG_DIR": snapshots + "/logs",
                     "EFDL_TTL": "3", "EFDL_LAST_CALL": "1"}
        members[0].start()                                     # one member of three: no quorum
        for h in world.hosts:
            pod_name = "%s-%s" % (job["metadata"]["name"],
                                  "".join(random.choice(string.ascii_lowercase + string.digits)
                                          for _ in range(5)))
            argv = trainer["command"][:1] + [start_sh] + trainer["args"]
            pods.append(cluster.Agent(pod_name, h.enter_prefix(world.shared) + argv,
                                      pod_env(trainer, h, pod_name, overrides)))
        time.sleep(8)
        for p in pods:
            out = p.output()
            assert p.proc.poll() is None, out
            assert "waiting for a quorum of etcd" in out and "efdl:" not in out, out
        members[1].start()                                     # two of three: a majority
        for p in pods:
            assert p.wait(150) == 0, p.output()[-4000:]
        outs = "\n".join(p.output() for p in pods)
        assert "training complete" in outs, outs[-4000:]
        for p, h in zip(pods, world.hosts):
            # The pod's name is the node id, its IP the advertised address.
            assert "node %s joined job 'digits'" % p.name in p.output(), p.output()[-3000:]
            assert "advertising %s" % h.addr in p.output(), p.output()[-3000:]
    finally:
        for p in pods:
            p.kill()
        for m in members:
            m.close()
        world.close()
    assert world.leftovers() == []
