"""A starved job slows down instead of churning (issue #37).

`efdl sim` (300 simulated nodes, the real rendezvous code on 8 shared driver threads, lease TTL
3 s) runs twice: free, then with the simulator and its private etcd (its child) in a cgroup that
allows them a fifth of one CPU. The starved run must be throttled, form and re-round in every
scenario, take longer than the free one, and cost about the same etcd requests per re-round (a
churning job - leases lost, nodes fenced and registering again, coordinators replaced - costs
many times N). Needs root and the cgroup v1 cpu controller (cpu.cfs_quota_us); skipped otherwise.
See docs/scale.md, "Overload".
"""
import json
import os
import subprocess
import time

import pytest

import faultlib

CG_ROOT = "/sys/fs/cgroup/cpu"
EFDL = faultlib.efdl_bin() or os.path.join(faultlib.REPO, "build", "efdl")
NODES = 300


def _cgroup_usable():
    return (os.geteuid() == 0 and os.path.exists(os.path.join(CG_ROOT, "cpu.cfs_quota_us"))
            and os.access(CG_ROOT, os.W_OK))


def run_sim(quota_us=None, timeout=300):
    """One `efdl sim --json` run; with quota_us, inside a fresh cgroup limited to quota_us per
    100 ms. Returns (report, throttled periods)."""
    cmd = [EFDL, "sim", "--nodes", str(NODES), "--ttl", "3", "--compare-max", "0",
           "--driver-threads", "8", "--clients", "4", "--json"]
    env = dict(os.environ, EFDL_LOG_LEVEL="error")
    cg = None
    preexec = None
    if quota_us is not None:
        cg = os.path.join(CG_ROOT, "efdl-starve-%d-%d" % (os.getpid(), time.monotonic_ns()))
        os.mkdir(cg)
        with open(os.path.join(cg, "cpu.cfs_period_us"), "w") as f:
            f.write("100000")
        with open(os.path.join(cg, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(quota_us))
        procs = os.path.join(cg, "cgroup.procs")

        def preexec():  # in the child, before exec: it and its etcd run in the cgroup
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    throttled = 0
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             preexec_fn=preexec)
    finally:
        if cg is not None:
            with open(os.path.join(cg, "cpu.stat")) as f:
                for line in f:
                    if line.startswith("nr_throttled "):
                        throttled = int(line.split()[1])
            # efdl sim stops its etcd before it exits; wait for the last process to leave.
            def emptied():
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    return not f.read().strip()
            faultlib.cluster.poll_until(emptied, 20, 0.1)
            os.rmdir(cg)
    lines = out.stdout.strip().splitlines()
    assert lines, "efdl sim printed nothing (rc %d): %s" % (out.returncode, out.stderr[-2000:])
    return json.loads(lines[-1]), throttled


@pytest.mark.skipif(not _cgroup_usable(),
                    reason="needs root and the cgroup v1 cpu controller at " + CG_ROOT)
def test_a_starved_job_forms_and_rerounds_only_slower():
    free, _ = run_sim()
    starved, throttled = run_sim(quota_us=20000)   # a fifth of one CPU for nodes and etcd
    report = "free: %s\nstarved: %s" % (json.dumps(free), json.dumps(starved))
    assert throttled > 0, "the cgroup never throttled the run\n" + report
    assert len(starved["scenarios"]) == 5, report
    for s in starved["scenarios"]:
        assert s["ok"], "%s did not complete while starved: %s\n%s" % (s["name"], s["error"],
                                                                        report)
    free_s = {s["name"]: s for s in free["scenarios"]}
    assert starved["scenarios"][0]["seconds"] > free_s["form"]["seconds"], report
    # Slower, not churning: a formation costs about 6 requests per node (lease grant, the
    # program check's 2 point reads, the register txn, the read of the coordinator's key, the
    # ack) and a re-round about one (the acks), starved as free.
    assert starved["scenarios"][0]["requests"] <= 7 * NODES + 50, report
    assert starved["scenarios"][0]["requests"] <= 1.25 * free_s["form"]["requests"] + 50, report
    for s in starved["scenarios"][1:]:
        assert s["requests"] <= 1.5 * NODES + 30, "%s churned\n%s" % (s["name"], report)
