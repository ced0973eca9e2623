"""The Kubernetes manifests in deploy/k8s parse and hold together.

They have not been applied to a cluster; these checks catch what breaks them before that: YAML
syntax, required fields, selectors that do not select the pod template, a job that does not run
`efdl run` against the etcd Service, ports that do not match, a grace period shorter than the
agent's stop sequence.
"""

import glob
import os
import re

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S_DIR = os.path.join(REPO, "deploy", "k8s")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def manifest_files():
    return sorted(glob.glob(os.path.join(K8S_DIR, "*.yaml")))


def load_all():
    """[(file name, document)] for every non-empty document of every manifest."""
    docs = []
    for path in manifest_files():
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    docs.append((os.path.basename(path), doc))
    return docs


def by_kind(kind):
    return [d for _, d in load_all() if d["kind"] == kind]


def flag_values(args, flag):
    """Values of --flag=V / --flag V in an argument list, up to the first bare `--`."""
    values = []
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith(flag + "="):
            values.append(a[len(flag) + 1:])
        elif a == flag and i + 1 < len(args):
            values.append(args[i + 1])
    return values


def efdl_run_containers():
    """(workload, container, argv) of every container whose command is `efdl run`."""
    out = []
    for w in [d for _, d in load_all() if d["kind"] in WORKLOAD_KINDS]:
        for c in w["spec"]["template"]["spec"]["containers"]:
            argv = list(c.get("command", [])) + list(c.get("args", []))
            if len(argv) >= 2 and os.path.basename(argv[0]) == "efdl" and argv[1] == "run":
                out.append((w, c, argv[2:]))
    return out


def test_manifest_directory_has_the_etcd_and_job_manifests():
    names = [os.path.basename(p) for p in manifest_files()]
    assert "etcd.yaml" in names and "elastic-job.yaml" in names, names


@pytest.mark.parametrize("path", manifest_files(), ids=os.path.basename)
def test_every_document_has_api_version_kind_and_name(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    assert docs, "%s holds no YAML document" % path
    for doc in docs:
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], doc
        assert isinstance(doc.get("kind"), str) and doc["kind"], doc
        name = doc.get("metadata", {}).get("name")
        # DNS-1123 label: what Services and StatefulSets (whose names become host names) require.
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?",
                                                      name), (path, name)


def test_workload_selectors_match_their_pod_labels_and_containers_are_complete():
    workloads = [d for _, d in load_all() if d["kind"] in WORKLOAD_KINDS]
    assert {w["kind"] for w in workloads} == {"Deployment", "StatefulSet"}
    for w in workloads:
        assert w["apiVersion"] == "apps/v1"
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector and all(labels.get(k) == v for k, v in selector.items()), w["metadata"]
        pod = w["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c.get("name") and c.get("image"), c
            assert c.get("command"), "container %s has no command" % c["name"]
        mounts = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        assert mounts <= volumes | claims, (w["metadata"]["name"], mounts - volumes - claims)


def test_services_select_pods_of_a_workload_and_target_their_ports():
    workloads = [d for _, d in load_all() if d["kind"] in WORKLOAD_KINDS]
    for svc in by_kind("Service"):
        selector = svc["spec"]["selector"]
        targets = [w for w in workloads
                   if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                          for k, v in selector.items())]
        assert targets, "Service %s selects no workload" % svc["metadata"]["name"]
        for w in targets:
            container_ports = {p["containerPort"] for c in w["spec"]["template"]["spec"]
                               ["containers"] for p in c.get("ports", [])}
            for p in svc["spec"]["ports"]:
                assert p.get("targetPort", p["port"]) in container_ports, (svc["metadata"], p)


def test_etcd_statefulset_has_three_members_behind_a_headless_service():
    (sts,) = by_kind("StatefulSet")
    assert sts["spec"]["replicas"] == 3
    svc = [s for s in by_kind("Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert svc and svc[0]["spec"].get("clusterIP") == "None", "serviceName must be headless"
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    args = etcd.get("args", [])
    initial = flag_values(args, "--initial-cluster")
    assert len(initial) == 1
    members = dict(m.split("=", 1) for m in initial[0].split(","))
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    # StatefulSet pods are <name>-0..N-1 and resolve as <pod>.<service>.
    assert sorted(members) == ["%s-%d" % (name, i) for i in range(3)]
    peer_port = next(p["port"] for p in svc[0]["spec"]["ports"] if p["name"] == "peer")
    for member, url in members.items():
        assert url.startswith("http://%s.%s." % (member, service)), url
        assert url.endswith(":%d" % peer_port), url


def test_job_runs_efdl_run_against_the_etcd_service_with_node_bounds():
    runs = efdl_run_containers()
    assert len(runs) == 1, "expected one container running `efdl run`"
    workload, container, args = runs[0]
    assert workload["kind"] in WORKLOAD_KINDS  # so `kubectl scale` changes the node count

    (etcd_sts,) = by_kind("StatefulSet")
    service = etcd_sts["spec"]["serviceName"]
    (svc,) = [s for s in by_kind("Service") if s["metadata"]["name"] == service]
    client_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
    (endpoints,) = flag_values(args, "--etcd")
    hosts = endpoints.split(",")
    assert len(hosts) == etcd_sts["spec"]["replicas"]
    for h in hosts:
        host, port = h.rsplit(":", 1)
        assert int(port) == client_port, h
        assert host.split(".")[1] == service, "%s is not a member of Service %s" % (h, service)

    (nnodes,) = flag_values(args, "--nnodes")
    lo, hi = (int(x) for x in nnodes.split(":"))
    assert 1 <= lo <= hi
    assert lo <= workload["spec"]["replicas"] <= hi
    assert flag_values(args, "--job"), "--job is required with --etcd"
    assert "--" in args and args.index("--") < len(args) - 1, "no training command after --"


def test_job_node_identity_comes_from_the_downward_api():
    (_, container, args) = efdl_run_containers()[0]
    env = {e["name"]: e for e in container.get("env", [])}

    def field_of(flag):
        (value,) = flag_values(args, flag)
        m = re.fullmatch(r"\$\((\w+)\)", value)
        assert m, "%s=%s should come from an env var" % (flag, value)
        return env[m.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]

    assert field_of("--node-id") == "metadata.name"
    assert field_of("--advertise-addr") == "status.podIP"


def test_termination_grace_covers_the_agent_stop_sequence():
    (workload, _, args) = efdl_run_containers()[0]
    (grace,) = flag_values(args, "--stop-grace")
    # A stop request, SIGTERM after --stop-grace, SIGKILL after another --stop-grace.
    period = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period > 2 * float(grace), (period, grace)


def test_snapshot_dir_is_a_mounted_shared_volume_and_shm_is_memory_backed():
    (workload, container, args) = efdl_run_containers()[0]
    (snapshot_dir,) = flag_values(args, "--snapshot-dir")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert snapshot_dir in mounts, "--snapshot-dir %s is not a mounted volume" % snapshot_dir
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mounts[snapshot_dir]]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [p for p in by_kind("PersistentVolumeClaim") if p["metadata"]["name"] == claim]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
