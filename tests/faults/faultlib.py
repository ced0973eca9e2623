"""The fault suite's harness: a loopback job (real etcd, real `efdl run` agents running
tests/faults/worker.py) plus the checks every case makes afterwards.

What the checks mean (docs/reliability.md has the same definitions):

- finished: every agent expected to finish exits 0, and every rank of the last round prints
  DONE with step == the job's step count.
- same_resume: in every round all ranks restored the same step (one consistent state).
- consecutive: in every round each rank's steps are resume+1, resume+2, ... without gaps.
- no_stale_round: rounds never overlap in time: every STEP of round r (its all-reduce completed,
  so every rank of round r took part) has an earlier wall-clock time than every STEP of any
  round r' > r, except a line that a frozen worker prints late (stopped after the all-reduce,
  before the print) for a step some rank of round r had printed before round r' began. A
  fenced or partitioned node therefore never trained after it was replaced.
- acked_kept: let F be the fault time and S the nodes whose shared memory survived it. The first
  round that resumes after F restores a step >= the highest step whose commit() returned (ACK)
  before F on a node of S. When no node survived, the bound is the newest snapshot in storage
  right after the fault. The restored step is also never above a step some rank finished.
- intact: every state restored with a step > 0 has the CRC (worker.py) of a COMMIT of that
  step printed earlier: no rank ever resumed from a torn or foreign snapshot.
- no_leftovers: once the agents have exited (or were killed by the case), every process that
  ran in an agent's session (agents lead their own sessions; workers and their children inherit
  them) is gone: those alive at the end and every one seen while the job ran (sampled 10x/s).

Every process started here is killed by pid / process group in close(), whatever happened,
after the checks: the checks see what the product left, never what the harness killed.
"""

import base64
import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "python", "workers"))
import cluster  # noqa: E402

PYTHON = cluster.PYTHON
WORKER = os.path.join(HERE, "worker.py")
LINE_RE = re.compile(r"^(?:\[rank \d+\] )?"
                     r"(RESUME|STEP|COMMIT|ACK|DONE|HANGING|FAILING|PAUSING|SLOWFIRST) (.*) t=([\d.]+)$")


efdl_bin = cluster.efdl_bin


def describe(pids):
    """"<pid> <command line>" of each process still there, for a failure message."""
    out = []
    for pid in pids:
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                out.append("%d %s" % (pid, f.read().replace(b"\0", b" ")[:200].decode(
                    errors="replace")))
        except OSError:
            pass
    return out


def _stat(pid):
    """(state, session id, start time) of a live process, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[3]), int(fields[19])


class ProcessTracker:
    """Samples /proc every 0.1 s for processes in the sessions it watches, remembering each
    (pid, start time), so processes that come and go between checks are accounted for too."""

    def __init__(self):
        self.sessions = set()
        self.seen = {}                      # pid -> start time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, sid):
        with self._lock:
            self.sessions.add(sid)

    def _scan(self):
        with self._lock:
            sessions = set(self.sessions)
        found = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None and st[1] in sessions and st[0] != "Z":
                    found[int(entry)] = st[2]
        with self._lock:
            self.seen.update(found)
        return found

    def _run(self):
        while not self._stop.wait(0.1):
            self._scan()

    def of_session(self, sid):
        """Processes of session `sid` alive now (zombies excluded), as pids."""
        return sorted(pid for pid, st in ((int(e), _stat(int(e))) for e in os.listdir("/proc")
                                          if e.isdigit())
                      if st is not None and st[1] == sid and st[0] != "Z")

    def leftovers(self):
        """Processes of the watched sessions alive now (zombies excluded), as pids."""
        alive = set(self._scan())
        with self._lock:
            for pid, start in self.seen.items():
                st = _stat(pid)
                if st is not None and st[2] == start and st[0] != "Z":
                    alive.add(pid)
        return sorted(alive)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)


class Job:
    """One job: etcd, agents (`nodes`, by name), output parsing and the checks."""

    def __init__(self, name, steps=40, step_time=0.05, nnodes="2:3", env=None,
                 snapshot_dir=None, in_memory=False):
        """in_memory: the nodes' shared memory and storage live in a temporary directory on
        /dev/shm (large states: no disk writeback competing with the job)."""
        self.c = cluster.Cluster(job="%s-%d" % (name, os.getpid()))
        self.dir = self.c.dir
        self.mem_dir = None
        if in_memory and os.path.isdir("/dev/shm"):
            self.mem_dir = tempfile.mkdtemp(prefix="efdl-faults-", dir="/dev/shm")
        self.steps = steps
        self.nnodes = nnodes
        self.snapshot_dir = snapshot_dir or os.path.join(self.mem_dir or self.dir, "snapshots")
        self.marks = os.path.join(self.dir, "marks")
        os.makedirs(self.marks)
        self.env = {"FAULT_STEPS": str(steps), "FAULT_STEP_TIME": str(step_time),
                    "FAULT_MARK_DIR": self.marks, "EFDL_PERSIST_MIN_INTERVAL_MS": "100"}
        self.env.update(env or {})
        self.nodes = {}                     # name -> cluster.Agent (the latest of that name)
        self.tracker = ProcessTracker()     # watches the agents' sessions

    # -- processes -----------------------------------------------------------------------------

    def start_etcd(self):
        return self.c.start_etcd()

    def shm_dir(self, node):
        path = os.path.join(self.mem_dir or self.dir, "shm", node)
        os.makedirs(path, exist_ok=True)
        return path

    def start_node(self, name, extra=(), env=None, nproc=1, nnodes=None, command=None,
                   ttl=None, prefix=(), host=None):
        """Starts `efdl run` for node `name`; its shared memory lives in shm/<name>, so a node
        restarted under the same name finds what its previous incarnation committed. host: a
        tests/python/workers/hosts.py Host to run it in (its own network, name, /dev/shm and
        /tmp; default network flags), instead of this machine's loopback."""
        e = dict(self.env)
        if host is None:
            e["EFDL_SHM_DIR"] = self.shm_dir(name)
        e.update(env or {})
        agent = self.c.start_agent(name, env=e, host=host, prefix=prefix,
                                   nnodes=nnodes or self.nnodes, nproc=nproc, extra=extra,
                                   command=command or [PYTHON, WORKER],
                                   snapshot_dir=self.snapshot_dir,
                                   ttl=3 if ttl is None else ttl)
        self.tracker.watch(agent.proc.pid)
        self.nodes[name] = agent
        return agent

    @property
    def all_agents(self):
        """Every agent started, in order (a node restarted under its name: each incarnation)."""
        return self.c.agents

    def groups_of(self, names):
        """The process groups of the nodes `names` (each agent's and its workers'), for
        signal_groups(): finding them in /proc is slow on a loaded machine."""
        groups = []
        for n in names:
            agent = self.nodes[n]
            groups += [agent.proc.pid] + agent.worker_pids()
        return groups

    def signal_nodes(self, names, sig=signal.SIGKILL):
        """`sig` to each node's agent group and its workers' groups, all at one moment.
        Returns (t0, t1): wall times right before the first and after the last signal (finding
        the groups in /proc is slow on a loaded machine, so it is done before t0)."""
        return self.signal_groups(self.groups_of(names), sig)

    def signal_groups(self, groups, sig=signal.SIGKILL):
        t0 = time.time()
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        return t0, time.time()

    def _wait_persisting(self, node, timeout):
        """Waits until the agent of node `node` writes a snapshot to storage (its temporary file
        .tmp-<host>-<agent pid>-<seq>.efdl exists); returns (directory, temporary file name)."""
        d = os.path.join(self.snapshot_dir, self.c.job)
        mark = "-%d-" % self.nodes[node].proc.pid

        def writing():
            try:
                return next((n for n in os.listdir(d) if n.startswith(".tmp-") and mark in n),
                            None)
            except OSError:
                return None
        return d, cluster.wait_for(writing, timeout, "node %s to write a snapshot to storage"
                                   % node, output=self.dump, interval=0.0005)

    @staticmethod
    def _seq_of(tmp):
        return int(tmp[:-len(".efdl")].rsplit("-", 1)[1])

    def kill_while_persisting(self, victims, writer, timeout=60):
        """SIGKILLs the nodes `victims` the moment the agent of node `writer` is writing a
        snapshot to storage. Returns (fault, seq): seq is the snapshot whose write the kill
        interrupted (its temporary file is still there afterwards, never renamed into place),
        or None when the write finished between the look and the kill (the caller tries
        again)."""
        groups = self.groups_of(victims)
        d, tmp = self._wait_persisting(writer, timeout)
        fault = self.signal_groups(groups)
        for v in victims:
            self.nodes[v].wait(10)
        interrupted = os.path.exists(os.path.join(d, tmp))
        return fault, (self._seq_of(tmp) if interrupted else None)

    def freeze_while_persisting(self, node, timeout=60):
        """SIGSTOPs node `node` (agent and workers) the moment its agent is writing a snapshot
        to storage. Returns (fault, tmp name, seq) once the write is certainly frozen half-done
        (its temporary file still there, not renamed, after the stop), else (fault, None, None)
        with the node left stopped (the caller decides)."""
        groups = self.groups_of([node])
        d, tmp = self._wait_persisting(node, timeout)
        fault = self.signal_groups(groups, signal.SIGSTOP)
        # SIGSTOP lands asynchronously, and a thread stops only on its way back from a system
        # call: once every thread of the agent (the writer) is stopped, a rename in flight at
        # the stop has landed and no other can start (not a fixed pause, which a loaded machine
        # can outlast).
        if not wait_stopped(self.nodes[node].proc.pid, 30):
            raise AssertionError("the agent of %s did not stop within 30 s of SIGSTOP\n%s"
                                 % (node, self.dump()))
        if os.path.exists(os.path.join(d, tmp)):
            return fault, tmp, self._seq_of(tmp)
        return fault, None, None

    def _stored(self):
        """The intact snapshot files in storage, as `efdl snapshots list --json` reads their
        names and manifests (rows with seq and step)."""
        proc = subprocess.run([efdl_bin(), "snapshots", "list", "--json", "--job", self.c.job,
                               "--snapshot-dir", self.snapshot_dir], env=cluster.base_env(),
                              capture_output=True, text=True, timeout=30)
        rows = json.loads(proc.stdout) if proc.stdout.strip().startswith("[") else []
        return [r for r in rows if r.get("ok")]

    def storage_files(self):
        """{seq: step} of the complete snapshot files in storage."""
        return {r["seq"]: r["step"] for r in self._stored()}

    def kill_node(self, name, sig=signal.SIGKILL):
        return self.signal_nodes([name], sig)

    def close(self):
        self.c.close()
        # A case that failed may leave processes of a dead agent's session (the checks ran
        # first and reported them): kill each by pid, if it is still the process seen.
        for pid in self.tracker.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.tracker.stop()
        if self.mem_dir:
            shutil.rmtree(self.mem_dir, ignore_errors=True)

    # -- inside commit() -------------------------------------------------------------------------

    def arena_path(self, node):
        paths = [p for p in glob.glob(os.path.join(self.shm_dir(node), "efdl-*.arena"))]
        return paths[0] if len(paths) == 1 else None

    def worker_pid(self, node, rank=None):
        """Pid of the node's newest worker (of `rank`), from its RESUME line."""
        evs = [e for e in self.events({"RESUME"}, [self.nodes[node]])
               if rank is None or e["rank"] == rank]
        return evs[-1]["pid"] if evs else None

    def marks_of(self, pid):
        """Steps announced by worker `pid` (FAULT_ANNOUNCE): (commit() begun, commit() returned)."""
        begun, returned = set(), set()
        for name in os.listdir(self.marks):
            kind, _, rest = name.partition("-")
            p, _, step = rest.partition("-")
            if kind in ("commit", "ack") and p == str(pid) and step.isdigit():
                (begun if kind == "commit" else returned).add(int(step))
        return begun, returned

    def kill_inside_commit(self, node, whole_node=True, rank=None, timeout=60):
        """SIGKILLs `node` (agent and workers; whole_node=False: only the arena-writing worker,
        the one of `rank`) at a moment its worker is certainly inside commit(), copying into
        its arena slot. The harness polls the node's arena header; when a slot turns `writing`
        it SIGSTOPs the worker, waits until every thread of it is stopped, and re-checks: the
        slot still `writing`, the worker announced commit-<pid>-<N> and not ack-<pid>-<N>.
        Then the kill; otherwise SIGCONT and the next commit is tried (a loaded machine may
        let a copy finish before the stop lands). Returns ((t0, t1), info) with the step N in
        flight, the arena's slots at the kill and the number of missed tries."""
        path = self.wait_for(lambda: self.arena_path(node), 30, "the arena of " + node)
        # A slot left `writing` by an earlier death is not a commit in progress; it stops
        # being stale once seen in another state (a later writer reused and published it).
        stale = {s["slot"] for s in arena_slots(path) if s["state"] == ARENA_WRITING}
        misses = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                slots = arena_slots(path)
            except (OSError, AssertionError, struct.error):
                slots = []
            stale -= {s["slot"] for s in slots if s["state"] != ARENA_WRITING}
            if not any(s["state"] == ARENA_WRITING and s["slot"] not in stale for s in slots):
                time.sleep(0.001)
                continue
            pid = self.worker_pid(node, rank)
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, TypeError):
                misses += 1
                continue
            stopped = wait_stopped(pid, 5)
            slots = arena_slots(path)
            begun, returned = self.marks_of(pid)
            in_flight = max(begun, default=0)
            # returned: an earlier commit of this worker, the one it must fall back to.
            if (stopped and returned and in_flight not in returned
                    and any(s["state"] == ARENA_WRITING and s["slot"] not in stale
                            for s in slots)):
                if whole_node:
                    fault = self.signal_nodes([node])
                else:
                    t0 = time.time()
                    os.killpg(pid, signal.SIGKILL)
                    fault = (t0, time.time())
                os.kill(pid, signal.SIGCONT)   # a stopped process dies of SIGKILL anyway
                return fault, {"pid": pid, "step": in_flight, "slots": slots,
                               "acked": max(returned), "misses": misses}
            os.kill(pid, signal.SIGCONT)
            misses += 1
        raise AssertionError("no kill inside commit() of %s within %ss (%d tries missed)\n%s" % (
            node, timeout, misses, self.dump()))

    def check_half_written_slot(self, node, info, slots=None):
        """After a kill inside commit() of step N: the node's arena holds the interrupted copy
        as a `writing` slot (never `ready`), and its newest ready slot is step N-1, the last
        acknowledged commit, whatever the slot count and whoever pinned a slot: the writer
        never takes the newest ready slot, it preempts a persister's pin instead (#35 part 3,
        docs/snapshots.md "Footprint"). `slots`: as read at the kill (a restarted worker may
        already be committing again). Returns the newest ready slot."""
        slots = slots or arena_slots(self.arena_path(node))
        ready = [s for s in slots if s["state"] == ARENA_READY]
        assert any(s["state"] == ARENA_WRITING for s in slots), slots
        assert ready, "no complete snapshot left in the arena of %s: %s" % (node, slots)
        newest = max(ready, key=lambda s: s["seq"])
        what = "arena of %s at the kill: %s; commit of step %d in flight, %d acknowledged" % (
            node, slots, info["step"], info["acked"])
        assert info["acked"] == info["step"] - 1, what
        assert newest["step"] == info["acked"], (
            "the last acknowledged commit is not in the arena any more: " + what)
        return newest

    # -- waiting -------------------------------------------------------------------------------

    def events(self, kinds=None, agents=None):
        """Parsed worker lines of all agents: dicts with kind, node, round, rank, step, t..."""
        out = []
        for a in agents or self.all_agents:
            for line in a.output().splitlines():
                m = LINE_RE.match(line)
                if m and (kinds is None or m.group(1) in kinds):
                    ev = {"kind": m.group(1), "node": a.name, "t": float(m.group(3))}
                    for kv in m.group(2).split():
                        k, v = kv.split("=", 1)
                        ev[k] = int(v)
                    out.append(ev)
        return out

    def wait_for(self, predicate, timeout, what):
        return cluster.wait_for(predicate, timeout, what, output=self.dump)

    def wait_step(self, step, world=None, nodes=None, timeout=90):
        """Waits until some rank (of a round of `world` ranks) finished `step`."""
        agents = [self.nodes[n] for n in nodes] if nodes else None

        def reached():
            return any(e["step"] >= step and (world is None or e["world"] == world)
                       for e in self.events({"STEP"}, agents))
        self.wait_for(reached, timeout, "step %d (world %s)" % (step, world))

    def wait_round(self, world, since, timeout=90):
        """Waits for a round of `world` ranks that resumed after wall time `since`; returns
        its RESUME events once all ranks printed one."""
        def found():
            rounds = {}
            for e in self.events({"RESUME"}):
                if e["t"] >= since and e["world"] == world:
                    rounds.setdefault(e["round"], []).append(e)
            full = [r for r in rounds.values() if len({e["rank"] for e in r}) == world]
            return full[0] if full else None
        return self.wait_for(found, timeout, "a round of world %d after the fault" % world)

    def wait_exit(self, names, timeout=120):
        codes = {}
        deadline = time.monotonic() + timeout
        for n in names:
            codes[n] = self.nodes[n].wait(max(deadline - time.monotonic(), 1))
        return codes

    def dump(self, tail=None):
        # FAULT_DUMP_TAIL: characters of each agent's output shown on a failure (default 2500).
        # Before that tail, the agent's own lines (not its workers' "[rank N]" ones), the last
        # 150: what the agent decided (a fence, a lost lease, a round) is often early in a run
        # whose tail is all steps.
        tail = tail or int(os.environ.get("FAULT_DUMP_TAIL", "2500"))
        out = []
        for a in self.all_agents:
            text = a.output()
            own = a.own_output().splitlines()
            out.append("==== %s (exit %s): agent lines\n%s\n---- output tail\n%s" % (
                a.name, a.proc.poll(), "\n".join(own[-150:]), text[-tail:]))
        return "\n".join(out)

    def wait_registrations_gone(self, names, timeout=30):
        """Waits until etcd dropped the dead nodes' registrations (their leases expired)."""
        prefix = "/efdl/%s/nodes/" % self.c.job

        def gone():
            proc = self._etcdctl("get", "--prefix", "--keys-only", prefix)
            return proc.returncode == 0 and not any(
                line.strip() == prefix + n for line in proc.stdout.splitlines() for n in names)
        self.wait_for(gone, timeout, "the registrations of %s to expire" % names)

    def _etcdctl(self, *args):
        return subprocess.run(["etcdctl", "--endpoints", self.c.endpoint] + list(args),
                              capture_output=True, text=True, timeout=30,
                              env=dict(cluster.base_env(), ETCDCTL_API="3"))

    def etcd_revision(self):
        """etcd's current revision (the harness's own read: one key of the job's prefix)."""
        proc = self._etcdctl("get", "--prefix", "--limit=1", "-w", "json", "/efdl/%s/" % self.c.job)
        assert proc.returncode == 0, proc.stderr
        return int(json.loads(proc.stdout)["header"]["revision"])

    def etcd_history(self, rev, timeout=30):
        """Every event under the job's keys after etcd revision `rev` up to the revision current
        now, from etcd's own history (a watch from rev + 1: values since overwritten or deleted
        show too): ([(PUT|DELETE, key, value, mod_revision)], the last revision the watch
        reached, the revision current when called)."""
        upto = self.etcd_revision()
        if upto <= rev:
            return [], rev, upto
        proc = subprocess.Popen(["etcdctl", "--endpoints", self.c.endpoint, "watch", "--prefix",
                                 "--rev=%d" % (rev + 1), "-w", "json", "/efdl/%s/" % self.c.job],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=dict(cluster.base_env(), ETCDCTL_API="3"))
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        events, seen = [], rev
        try:
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue
                for ev in json.loads(line).get("Events") or []:
                    kv = ev["kv"]
                    mod = int(kv["mod_revision"])
                    seen = max(seen, mod)
                    if mod <= upto:
                        events.append(("DELETE" if ev.get("type", 0) == 1 else "PUT",
                                       base64.b64decode(kv["key"]).decode(),
                                       base64.b64decode(kv.get("value", "")).decode(), mod))
                if seen >= upto:
                    break
        finally:
            timer.cancel()
            proc.kill()
            proc.wait()
        return events, seen, upto

    def etcd_puts_since(self, rev, timeout=30):
        """Every PUT under the job's keys after etcd revision `rev` up to the revision current
        now (etcd_history): [(key, value, mod_revision)]; the history must reach that revision."""
        events, seen, upto = self.etcd_history(rev, timeout)
        assert seen >= upto, "etcd's history after revision %d ended at %d, not %d" % (
            rev, seen, upto)
        return [(key, value, mod) for kind, key, value, mod in events if kind == "PUT"]

    def check_no_stale_etcd_writes(self, rev, current_round, node, rejoined_round):
        """After etcd revision `rev` (taken while round `current_round` trained without node
        `node`, before it was thawed), no write to the job's keys is for an older round (a
        record whose "r" or "round" is below `current_round`: round, assign, ack, status,
        complete), and nothing written as `node` (its ack, a round or status record naming it
        coordinator) is for a round before `rejoined_round`, the one it came back in. Returns
        how many writes were read."""
        puts = self.etcd_puts_since(rev)
        stale = []
        for key, value, mod in puts:
            try:
                record = json.loads(value)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            r = record.get("r", record.get("round"))
            if not isinstance(r, int):
                continue
            as_node = (key.endswith("/ack/" + node) or record.get("c") == node
                       or record.get("coordinator") == node)
            if r < current_round or (as_node and r < rejoined_round):
                stale.append((mod, key, value[:160]))
        assert not stale, ("written to etcd after revision %d for a round older than %d, or by "
                           "%s before its round %d:\n%s\n%s"
                           % (rev, current_round, node, rejoined_round,
                              "\n".join(map(str, stale)), self.dump()))
        return len(puts)

    def storage_steps(self):
        """Steps of the intact snapshots in storage, newest first."""
        return [r["step"] for r in sorted(self._stored(), key=lambda r: -r["seq"])]

    def storage_newest_step(self):
        """Step of the newest intact snapshot in storage (-1: none)."""
        return max(self.storage_steps(), default=-1)

    # -- checks --------------------------------------------------------------------------------

    def max_ack_before(self, t, nodes):
        # Data-parallel: local rank 0 writes the node's snapshot; the other local ranks'
        # commit() returns without waiting for it, so their ACK acknowledges nothing.
        acks = [e["step"] for e in self.events({"ACK"})
                if e["t"] < t and e["node"] in nodes and e.get("lr", 0) == 0]
        return max(acks, default=0)

    def check_finished(self, names, timeout=120):
        codes = self.wait_exit(names, timeout)
        assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes, self.dump())
        done = self.events({"DONE"})
        assert done, "no DONE line\n" + self.dump()
        last_round = max(e["round"] for e in done)
        final = [e for e in done if e["round"] == last_round]
        assert len({e["rank"] for e in final}) == final[0]["world"], final
        assert all(e["step"] == self.steps for e in final), final

    def check_rounds(self):
        steps = self.events({"STEP"})
        resumes = self.events({"RESUME"})
        by_round = {}
        for e in steps:
            by_round.setdefault(e["round"], []).append(e)
        for r, evs in by_round.items():
            res = {e["rank"]: e["step"] for e in resumes if e["round"] == r}
            assert len(set(res.values())) == 1, (
                "round %d: ranks restored different steps %s\n%s" % (r, res, self.dump()))
            start = next(iter(res.values()))
            for rank in {e["rank"] for e in evs}:
                mine = [e["step"] for e in evs if e["rank"] == rank]
                assert mine == list(range(start + 1, start + 1 + len(mine))), (
                    "round %d rank %d: steps %s after resuming at %d" % (r, rank, mine, start))
        rounds = sorted(by_round)
        for older, newer in zip(rounds, rounds[1:]):
            first_new = min(e["t"] for e in by_round[newer])
            before = [e["step"] for e in by_round[older] if e["t"] < first_new]
            # A STEP line is stamped when printed: a worker frozen (SIGSTOP) after its step's
            # all-reduce finished but before the print prints it on SIGCONT, after the next
            # round began. That step was finished by the whole old round in time; training on
            # in a stale round is a step that no rank of that round had reached before.
            for e in by_round[older]:
                assert e["t"] < first_new or e["step"] <= max(before, default=0), (
                    "round %d still stepped (rank %d, step %d) %.3f s after round %d began\n%s"
                    % (older, e["rank"], e["step"], e["t"] - first_new, newer, self.dump()))

    def check_acked_kept(self, fault, survivors, floor=None):
        """The first round resuming after the fault restored >= the bound (module doc).
        `fault` is (t0, t1) from signal_nodes(): acknowledged before t0 must be kept; nothing
        finished after t1 can have been restored."""
        t0, t1 = fault
        later = [e for e in self.events({"RESUME"}) if e["t"] > t1]
        assert later, "no round resumed after the fault\n" + self.dump()
        first_round = min(e["round"] for e in later)
        restored = max(e["step"] for e in later if e["round"] == first_round)
        bound = self.max_ack_before(t0, survivors) if floor is None else floor
        assert restored >= bound, ("round %d restored step %d, but step %d was acknowledged "
                                   "before the fault\n%s" % (first_round, restored, bound,
                                                             self.dump()))
        first_resume = min(e["t"] for e in later if e["round"] == first_round)
        finished = max((e["step"] for e in self.events({"STEP"}) if e["t"] < first_resume),
                       default=0)
        assert restored <= finished, ("round %d restored step %d, but no rank had finished a "
                                      "step beyond %d" % (first_round, restored, finished))
        return restored, bound

    def check_no_leftovers(self, timeout=15):
        """Nothing of any agent's session outlives the agents; etcd is the harness's own."""
        running = [a.name for a in self.all_agents if a.proc.poll() is None]
        assert not running, "agents still running: %s" % running
        cluster.poll_until(lambda: not self.tracker.leftovers(), timeout, 0.1)
        left = self.tracker.leftovers()
        assert not left, "processes left behind: %s" % describe(left)

    def check_intact(self):
        commits = {}
        for e in self.events({"COMMIT"}):
            commits.setdefault((e["step"], e["crc"]), e["t"])
        for e in self.events({"RESUME"}):
            if e["step"] > 0:
                t = commits.get((e["step"], e["crc"]))
                assert t is not None and t < e["t"], (
                    "round %d rank %d restored step %d with crc %d, which no COMMIT of that step "
                    "had (src %d seq %d)\n%s" % (e["round"], e["rank"], e["step"], e["crc"],
                                                 e["src"], e["seq"], self.dump()))

    def check_all(self, finishers, timeout=120):
        self.check_finished(finishers, timeout)
        self.check_rounds()
        self.check_intact()


class RenamesFrom:
    """Records every file of directory `path` renamed to another name (inotify IN_MOVED_FROM,
    through libc: a temporary file published as a snapshot), with the wall time it was seen; a
    file published and pruned a moment later still shows. Stop with close()."""

    IN_MOVED_FROM = 0x00000040
    IN_NONBLOCK = 0o4000

    def __init__(self, path):
        import ctypes
        import struct
        self._struct = struct
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(self.IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self._fd, os.fsencode(path), self.IN_MOVED_FROM) < 0:
            os.close(self._fd)
            raise OSError(ctypes.get_errno(), "inotify_add_watch %s" % path)
        self.seen = []          # (wall time, file name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import select
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            if not ready:
                continue
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                continue
            at, off = time.time(), 0
            while off + 16 <= len(data):
                _, _, _, n = self._struct.unpack_from("iIII", data, off)
                name = data[off + 16:off + 16 + n].split(b"\0", 1)[0].decode()
                self.seen.append((at, name))
                off += 16 + n

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        os.close(self._fd)


# -- shared-memory arena (docs/snapshots.md, src/snapshot/arena.cc) ---------------------------

ARENA_EMPTY, ARENA_WRITING, ARENA_READY = 0, 1, 2


def arena_slots(path):
    """The slot table of an arena's header page: per slot its state, pin pid, seq and step
    (the header is 64 bytes, then one 64-byte record per slot: u32 state, u32 pin_pid,
    u64 seq, i64 step, ...)."""
    with open(path, "rb") as f:
        head = f.read(64 + 4 * 64)
    magic, _, num = struct.unpack_from("<8sII", head, 0)
    assert magic == b"EFDLARN1", "not an arena: %s" % path
    slots = []
    for i in range(num):
        state, pin, seq, step = struct.unpack_from("<IIQq", head, 64 + 64 * i)
        slots.append({"slot": i, "state": state, "pin": pin, "seq": seq, "step": step})
    return slots


def wait_stopped(pid, timeout):
    """True once every thread of `pid` is in the stopped state (SIGSTOP lands asynchronously);
    False when it is gone or `timeout` seconds passed first."""
    def stopped():
        try:
            states = []
            for tid in os.listdir("/proc/%d/task" % pid):
                with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return "gone"
        return bool(states) and all(s in ("T", "t") for s in states)
    return cluster.poll_until(stopped, timeout, 0.0005) is True


# -- etcd ------------------------------------------------------------------------------------

def restart_etcd(job):
    """Starts the job's single etcd again with the same ports and data directory."""
    job.c.etcd.start()


class EtcdOutage:
    """An outage of the job's single etcd made by etcd_outage(), in wall times: `killed` right
    before the SIGKILL, `dead` once etcd was reaped, `restarted` right before it was started
    again, `healthy` once it first answered /health. etcd certainly served nothing from `dead`
    to `restarted`, and served again by `healthy`: the outage lasted at least `least` and at
    most `most` seconds, whatever this machine's speed and etcd's start-up."""

    def __init__(self, killed, dead, restarted, healthy):
        self.killed, self.dead, self.restarted, self.healthy = killed, dead, restarted, healthy
        self.least = restarted - dead
        self.most = healthy - killed

    def within(self, low, high):
        """True when the outage certainly lasted more than `low` and less than `high` s."""
        return self.least > low and self.most < high

    def __str__(self):
        return ("etcd killed at %.3f (reaped %.3f), started again at %.3f, healthy at %.3f: "
                "down at least %.2f s, at most %.2f s" % (self.killed, self.dead, self.restarted,
                                                          self.healthy, self.least, self.most))


def etcd_outage(job, down_for):
    """SIGKILLs the job's etcd and starts it again (same ports and data directory) `down_for`
    seconds after it was reaped, measured, not assumed: the restart moment comes from the
    measured time of the death, so etcd's own start-up only lengthens the outage. Returns the
    EtcdOutage; the caller checks it is the outage it needs (a loaded machine can oversleep or
    start etcd slowly) and makes it again, on a fresh set-up, when it is not."""
    killed = time.time()
    job.c.etcd.kill()
    dead = time.time()
    time.sleep(max(0.0, dead + down_for - time.time()))
    restarted = time.time()
    restart_etcd(job)
    return EtcdOutage(killed, dead, restarted, time.time())


class EtcdCluster:
    """`size` etcd members (cluster.Etcd) on loopback, for member-failure cases."""

    def __init__(self, base_dir, size=3, host="127.0.0.1"):
        peers = [cluster.free_port() for _ in range(size)]
        initial = ",".join("m%d=http://127.0.0.1:%d" % (i, p) for i, p in enumerate(peers))
        # A member of a new cluster is healthy only once a quorum runs: all start, then wait.
        self.members = [cluster.Etcd(os.path.join(base_dir, "m%d" % i),
                                     os.path.join(base_dir, "etcd-m%d.log" % i), name="m%d" % i,
                                     host=host, peer_port=peer, initial_cluster=initial,
                                     wait=False)
                        for i, peer in enumerate(peers)]
        self.endpoints = [m.endpoint for m in self.members]
        for m in self.members:
            m.wait_healthy(60)

    def leader(self, timeout=30):
        """The index of the raft leader, as the members report it (etcd's JSON gateway,
        /v3/maintenance/status: each member's id and the leader's id)."""
        import urllib.request

        def find():
            ids, leader = {}, None
            for i, endpoint in enumerate(self.endpoints):
                if self.members[i].proc.poll() is not None:
                    continue
                try:
                    req = urllib.request.Request("http://%s/v3/maintenance/status" % endpoint,
                                                 data=b"{}", method="POST")
                    with urllib.request.urlopen(req, timeout=2) as r:
                        status = json.loads(r.read())
                except OSError:
                    continue
                ids[status["header"]["member_id"]] = i
                leader = status.get("leader", leader)
            return (ids[leader],) if leader in ids else None
        return cluster.wait_for(find, timeout, "an etcd member to report a leader",
                                interval=0.1)[0]

    def kill(self, i):
        self.members[i].kill()

    def close(self):
        for m in self.members:
            m.kill()


# -- storage ---------------------------------------------------------------------------------

class Tmpfs:
    """A small tmpfs mounted at `path` (root only); unmounted by close()."""

    def __init__(self, path, size):
        os.makedirs(path, exist_ok=True)
        self.path = path
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s" % size, "tmpfs", path],
                              capture_output=True, text=True)
        self.mounted = proc.returncode == 0
        self.error = proc.stderr.strip()

    def remount_ro(self, timeout=10.0):
        """Turns the mount read-only. The kernel refuses (EBUSY, "mount point is busy") while a
        file on it is open for writing — the persister's temporary, for a few milliseconds — so
        retry until it goes through (a failing disk does not wait for writers; the test only
        needs the moment after)."""
        errors = []

        def remount():
            proc = subprocess.run(["mount", "-o", "remount,ro", self.path],
                                  capture_output=True, text=True)
            errors[:] = [proc.stderr.strip()]
            return proc.returncode == 0
        if not cluster.poll_until(remount, timeout, 0.02):
            raise AssertionError("cannot remount %s read-only for %.0f s: %s"
                                 % (self.path, timeout, errors[0]))

    def close(self):
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], capture_output=True)
            self.mounted = False
