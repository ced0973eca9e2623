#!/usr/bin/python3
"""Prints deploy/k8s's manifests with your values, for `kubectl apply -f -`:

    deploy/k8s/render.py --image registry.example.com/efdl:0.1 --job digits-2 --nodes 4 \\
        --nnodes 2:8 --etcd etcd-a:2379,etcd-b:2379 --no-etcd | kubectl apply -f -

Without options it prints the manifests as they are. Each option changes the one field it names
(structured edits of the parsed YAML, no text templating); --no-etcd leaves out etcd.yaml (an
existing etcd given with --etcd). tests/python/test_deploy_manifests.py renders several sets and
validates each against the Kubernetes API schema.
"""

import argparse
import copy
import os
import re
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _trainer(docs):
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (c,) = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
    return job, c


def _set_env(container, name, value):
    for e in container["env"]:
        if e["name"] == name:
            e.clear()
            e.update({"name": name, "value": value})
            return
    container["env"].append({"name": name, "value": value})


def render(image=None, job_id=None, nodes=None, nnodes=None, etcd=None, with_etcd=True,
           command=None, shm=None):
    """The manifests' documents with the given values (None: as in the files)."""
    etcd_docs = load("etcd.yaml")
    job_docs = copy.deepcopy(load("elastic-job.yaml"))
    job, trainer = _trainer(job_docs)
    if image is not None:
        trainer["image"] = image
    if job_id is not None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", job_id):
            raise ValueError("--job %r: use lower-case letters, digits and '-' (at most 63): it "
                             "also names the Job and its ConfigMap" % job_id)
        _set_env(trainer, "EFDL_JOB_ID", job_id)
        old = job["metadata"]["name"]
        for d in job_docs:
            if d["kind"] in ("Job", "ConfigMap"):
                d["metadata"]["name"] = d["metadata"]["name"].replace(old, "efdl-" + job_id)
                d["metadata"]["labels"]["app.kubernetes.io/name"] = "efdl-" + job_id
        job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = \
            "efdl-" + job_id
        for v in job["spec"]["template"]["spec"]["volumes"]:
            if "configMap" in v:
                v["configMap"]["name"] = v["configMap"]["name"].replace(old, "efdl-" + job_id)
    if nodes is not None:
        job["spec"]["parallelism"] = nodes
    if nnodes is not None:
        _set_env(trainer, "EFDL_NNODES", nnodes)
    if etcd is not None:
        _set_env(trainer, "EFDL_ETCD_ENDPOINTS", etcd)
    if command is not None:
        trainer["args"] = list(command)
    if shm is not None:
        for v in job["spec"]["template"]["spec"]["volumes"]:
            if v["name"] == "shm":
                v["emptyDir"]["sizeLimit"] = shm
    return (etcd_docs if with_etcd else []) + job_docs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", help="the EFDL image (deploy/Dockerfile, or one built FROM it)")
    p.add_argument("--job", dest="job_id", help="EFDL job id; also names the Job (efdl-JOB)")
    p.add_argument("--nodes", type=int, help="pods to start (the Job's parallelism)")
    p.add_argument("--nnodes", help="MIN:MAX nodes of the EFDL job (EFDL_NNODES)")
    p.add_argument("--etcd", help="etcd endpoints HOST:PORT,... (EFDL_ETCD_ENDPOINTS)")
    p.add_argument("--no-etcd", action="store_true", help="leave out etcd.yaml")
    p.add_argument("--shm", help="size of the pods' /dev/shm, e.g. 8Gi")
    p.add_argument("command", nargs="*", help="training command (after --)")
    a = p.parse_args()
    if a.nodes is not None and a.nodes < 1:
        p.error("--nodes %d: give at least 1" % a.nodes)
    try:
        docs = render(a.image, a.job_id, a.nodes, a.nnodes, a.etcd, not a.no_etcd,
                      a.command or None, a.shm)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))


if __name__ == "__main__":
    main()
