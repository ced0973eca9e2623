"""EFDL under a real Slurm (issue #36): slurmctld, munged and one slurmd per simulated host
(tests/python/workers/slurm.py on tests/python/workers/hosts.py), running the batch script users
copy, examples/slurm/digits.sbatch, with examples/train_ddp_state.py (the digits program).

  (a) a node lost mid-run (its host killed: slurmd, step and workers) -> the job goes on on the
      others and completes, having lost no more than one commit interval;
  (b) a second allocation submitted with the same EFDL job id joins the running job;
  (c) `scancel --signal=USR1 --batch` (what `#SBATCH --signal=B:USR1@T` sends before the time
      limit) -> EFDL suspends, the script requeues the job, and the requeued job continues at
      the step it stopped at (0 steps lost);
  (d) `scancel` of the whole job leaves no process and no arena on any node.

The script runs as a user runs it: no --job (efdl's default inside Slurm is slurm-$SLURM_JOB_ID),
EFDL_* settings through sbatch's environment. Every wait is bounded; each test removes its
cluster, hosts, etcd and directories whatever happens.
"""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))

import cluster  # noqa: E402
import hosts  # noqa: E402
import slurm  # noqa: E402

REPO = cluster.REPO
SCRIPT = os.path.join(REPO, "examples", "slurm", "digits.sbatch")

_why = (hosts.HostWorld.unavailable() or slurm.SlurmCluster.unavailable() or
        (None if cluster.efdl_bin() else "efdl is not built"))
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))

# [rank 0] lines of examples/train_ddp_state.py.
STEP_RE = re.compile(r"^\[rank 0\] epoch (\d+) step (\d+) samples (\d+) loss \S+ world (\d+)",
                     re.M)
RESUME_RE = re.compile(r"^\[rank 0\] resuming at epoch (\d+), sample (\d+) of the epoch, "
                       r"(\d+) samples in all, world (\d+)", re.M)
BATCH = 16           # the program's default --batch-size (per rank)
COMMIT_INTERVAL = 5  # its default --commit-interval


class Env:
    """A world of 3 hosts with Slurm on them, a submit directory every host sees, and (on
    demand) the site's etcd."""

    def __init__(self):
        self.world = hosts.HostWorld(3)
        self.slurm = None
        self.etcd = None
        try:
            self.slurm = slurm.SlurmCluster(self.world)
        except BaseException:
            self.world.close()
            raise
        self.submit_dir = os.path.join(self.world.shared, "submit")
        os.makedirs(self.submit_dir)

    def site_etcd(self):
        self.etcd = cluster.bridge_etcd(self.world)   # the site's etcd, outside every allocation
        return self.etcd.endpoint

    def env(self, extra=None):
        env = cluster.base_env()
        env["PATH"] = os.path.dirname(cluster.efdl_bin()) + os.pathsep + env["PATH"]
        env.update({"EFDL_HOME": REPO, "EFDL": cluster.efdl_bin(), "EFDL_TTL": "3",
                    "EFDL_LAST_CALL": "1", "EFDL_STOP_GRACE": "5"})
        env.update(extra or {})
        return env

    def submit(self, nodes, program_args, extra_env=None, args=()):
        return self.slurm.sbatch(SCRIPT, args=["--nodes=%d" % nodes] + list(args),
                                 script_args=program_args, env=self.env(extra_env),
                                 cwd=self.submit_dir)

    def output(self, job_id):
        try:
            with open(os.path.join(self.submit_dir, "efdl-digits-%s.out" % job_id),
                      errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_output(self, job_id, predicate, timeout, what):
        return cluster.wait_for(lambda: predicate(self.output(job_id)), timeout, what,
                                output=lambda: "job %s output:\n%s\n%s" % (
                                    job_id, self.output(job_id)[-6000:], self.slurm.logs(1500)),
                                interval=0.2)

    def wait_steps(self, job_id, world, count, timeout=240):
        """Waits until rank 0 printed `count` steps at world size `world`."""
        return self.wait_output(
            job_id, lambda out: len([m for m in STEP_RE.finditer(out)
                                     if int(m.group(4)) == world]) >= count,
            timeout, "%d steps at world %d" % (count, world))

    def close(self):
        try:
            if self.slurm is not None:
                self.slurm.close()
            if self.etcd is not None:
                self.etcd.close()
        finally:
            self.world.close()
        assert self.world.leftovers() == [], self.world.leftovers()


@pytest.fixture
def env():
    e = Env()
    try:
        yield e
    finally:
        e.close()


def test_the_cluster_runs_one_step_task_per_host_in_that_host_and_leaves_nothing():
    with hosts.HostWorld(2) as w:
        c = slurm.SlurmCluster(w)
        try:
            daemons = c.pids()
            assert len(daemons) == 4, daemons   # munged, slurmctld, 2 slurmd
            assert set(c.nodes().values()) == {"IDLE"}, c.nodes()
            run = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "sh", "-c",
                                  "echo $(hostname) $SLURM_NODEID $(cat /proc/1/comm)"],
                                 capture_output=True, text=True, timeout=60, env=c.env())
            assert run.returncode == 0, run.stderr + c.logs()
            lines = sorted(run.stdout.split("\n")[:2])
            # Each task runs inside its host: its name, and the host's PID namespace (whose
            # init is the world's `sleep`).
            assert lines == sorted("%s %d sleep" % (h.name, i) for i, h in enumerate(w.hosts))
        finally:
            c.close()
        assert not any(os.path.exists("/proc/%d" % p) and
                       open("/proc/%d/stat" % p).read().split()[2] != "Z" for p in daemons)
        assert not os.path.exists(c.dir)
        assert all(c.job_pids(h) == [] for h in w.hosts)
    assert w.leftovers() == []


def test_a_lost_node_mid_run_the_job_goes_on_losing_at_most_one_commit_interval(env):
    endpoint = env.site_etcd()
    job = env.submit(3, ["--epochs", "2", "--log-interval", "1", "--step-delay", "0.1"],
                     {"EFDL_ETCD_ENDPOINTS": endpoint, "EFDL_NNODES": "1:3"})
    env.wait_steps(job, world=3, count=8)
    # The batch script runs on the allocation's first node; the last one is lost as a whole:
    # its slurmd, its step (efdl run) and its workers, without warning.
    lost = env.world.hosts[2]
    assert env.slurm.job_pids(lost), "no process of the job on %s" % lost.name
    before = env.output(job)
    lost.kill()
    last_total = [int(m.group(3)) for m in STEP_RE.finditer(before)][-1]

    def resumed_at_two(out):
        later = [m for m in RESUME_RE.finditer(out) if int(m.group(4)) == 2]
        return later[0] if later else None
    resume = env.wait_output(job, resumed_at_two, 180, "a round of world 2 after the loss")
    lost_samples = last_total - int(resume.group(3))
    # At most the steps since the last commit: COMMIT_INTERVAL steps of the 3-node world.
    assert 0 <= lost_samples <= COMMIT_INTERVAL * BATCH * 3, (last_total, resume.group(0))
    env.wait_output(job, lambda out: "training complete" in out, 300, "the end of training")
    state = env.slurm.wait_job_state(job, ("COMPLETED", "FAILED"), 120)
    out = env.output(job)
    assert "efdl run ended" in out, out[-4000:]
    # Slurm saw the node fail (it was not cancelled along with it: --no-kill).
    assert state in ("COMPLETED", "FAILED"), state
    assert env.slurm.nodes()[lost.name].startswith(("DOWN", "IDLE*", "UNKNOWN")), \
        env.slurm.nodes()


def test_b_a_second_allocation_with_the_same_job_id_joins_the_running_job(env):
    program = ["--epochs", "3", "--log-interval", "1", "--step-delay", "0.1"]
    first = env.submit(2, program, {"EFDL_NNODES": "1:3"})
    env.wait_steps(first, world=2, count=5)
    # The first allocation started etcd on its first node (no site etcd given) and said where.
    endpoint = env.wait_output(
        first, lambda out: re.search(r"started etcd for this allocation at (\S+)", out),
        10, "the etcd address").group(1)
    # The same program with the same arguments (a job's nodes must agree on them).
    second = env.submit(1, program, {"EFDL_JOB_ID": "slurm-%s" % first,
                                "EFDL_ETCD_ENDPOINTS": endpoint, "EFDL_NNODES": "1:3",
                                "EFDL_ON_SIGNAL": "none"})
    env.slurm.wait_job_state(second, ("RUNNING",), 60)
    env.wait_steps(first, world=3, count=5, timeout=240)
    assert "job 'slurm-%s'" % first in env.output(second), env.output(second)[-3000:]
    env.wait_output(first, lambda out: "training complete" in out, 300, "the end of training")
    assert env.slurm.wait_job_state(first, ("COMPLETED", "FAILED"), 120) == "COMPLETED", \
        env.output(first)[-4000:]
    assert env.slurm.wait_job_state(second, ("COMPLETED", "FAILED"), 120) == "COMPLETED", \
        env.output(second)[-4000:]


def test_c_a_signal_suspends_and_the_requeued_job_resumes_at_the_step_it_stopped(env):
    endpoint = env.site_etcd()
    job = env.submit(2, ["--epochs", "2", "--log-interval", "1", "--step-delay", "0.1"],
                     {"EFDL_ETCD_ENDPOINTS": endpoint, "EFDL_NNODES": "1:2"})
    env.wait_steps(job, world=2, count=10)
    # What `#SBATCH --signal=B:USR1@120` sends 120 s before the time limit.
    env.slurm.scancel("--signal=USR1", "--batch", job)
    suspended = env.wait_output(
        job, lambda out: re.search(r"suspended at step (\d+)", out), 120, "the suspension")
    before = env.output(job)[:env.output(job).index(suspended.group(0))]
    last_total = [int(m.group(3)) for m in STEP_RE.finditer(before)][-1]
    env.wait_output(job, lambda out: "requeueing" in out, 60, "the requeue")
    # Slurm holds a requeued job for AuthInfo's cred_expire (120 s by default, 15 s in the
    # test cluster) before it may run again.
    seen = []

    def running_again():
        info = env.slurm.job(job)
        seen.append("%s/%s" % (info.get("JobState"), info.get("Reason")))
        return info.get("Restarts") == "1" and info.get("JobState") in (
            "RUNNING", "COMPLETING", "COMPLETED")
    try:
        cluster.wait_for(running_again, 120, "the requeued job to run again")
    except AssertionError as e:
        raise AssertionError("%s; states seen: %s\n%s\n%s" % (
            e, sorted(set(seen)), env.slurm.scontrol("show", "job", job).stdout,
            env.slurm.logs(3000)))
    env.wait_output(job, lambda out: "(restart 1): the job was suspended; resuming it" in out,
                    240, "the requeued run to resume the job")

    def resumed(out):
        after = out[out.index("(restart 1)"):]
        return RESUME_RE.search(after)
    resume = env.wait_output(job, resumed, 180, "the first round of the requeued run")
    events = "\n".join(l for l in env.output(job).splitlines() if re.search(
        r"efdl-slurm|resuming at|continues from|suspend|persisted|round \d+ formed", l))
    assert int(resume.group(3)) == last_total, (last_total, resume.group(0), events)  # 0 lost
    env.wait_output(job, lambda out: "training complete" in out, 300, "the end of training")
    assert env.slurm.wait_job_state(job, ("COMPLETED", "FAILED"), 120) == "COMPLETED"
    assert env.slurm.job(job).get("Restarts") == "1", env.slurm.job(job)


def test_d_scancel_of_the_whole_job_leaves_no_process_and_no_arena(env):
    job = env.submit(3, ["--epochs", "5", "--log-interval", "1", "--step-delay", "0.1"])
    env.wait_steps(job, world=3, count=5)
    for h in env.world.hosts:
        assert os.listdir(h.shm_dir), "no arena on %s while training" % h.name
    env.slurm.scancel(job)
    env.slurm.wait_job_state(job, ("CANCELLED",), 60)

    def clean():
        return all(env.slurm.job_pids(h) == [] for h in env.world.hosts) and all(
            os.listdir(h.shm_dir) == [] for h in env.world.hosts)
    cluster.poll_until(clean, 60, 0.2)
    for h in env.world.hosts:
        left = [open("/proc/%d/cmdline" % p, "rb").read().replace(b"\0", b" ")[:200]
                for p in env.slurm.job_pids(h) if os.path.exists("/proc/%d" % p)]
        assert left == [], (h.name, left)
        assert os.listdir(h.shm_dir) == [], (h.name, os.listdir(h.shm_dir))
        # Nor the etcd the script started (its data directory in the first node's /tmp).
        assert [n for n in os.listdir(h.tmp_dir) if n.startswith("efdl-")] == [], h.name
