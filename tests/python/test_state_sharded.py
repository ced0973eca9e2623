"""efdl.State and sharded state (issue #35, part 1): torch's ZeroRedundancyOptimizer is held with
per-rank snapshots and resharded at a world-size change; what State still cannot restore across
one is refused at State(...) with one TypeError line.

The regression, the way a user tried it: a ZeroRedundancyOptimizer(Adam) program under State on
3 ranks, then on 2, then on 3 again. Each rank holds only its shard of the Adam state. Before
#35 (and with the refusal bypassed) the job finished without a warning, with every rank's Adam
state started over at the change: step counts of 6 or 4 where an uninterrupted run of the same
program counts 14 (the issue saw 59 against 276). Now every new rank rebuilds its shard of the
new layout from the old shards - this node's memory, storage, another rank over the network -
and the job ends with the parameters and the whole Adam state of an uninterrupted run. The rest:
the other refusals (FSDP, optimizers State knows nothing of), Horovod's TorchState (an
efdl.State), the setters, and the optimizers State keeps accepting. The pure logic of the
resharding (decide, base_of, plan) is tested in test_shards_plan.py.
"""

import json
import os
import shutil
import textwrap

import pytest
import torch

from conftest import PYTHON

from efdl import _parts
from efdl.state import State
from zero_results import whole_state  # tests/python/workers, on the path (conftest.py)

SUPPORTED = "State snapshots and restores replicated state"

# A small MLP under DDP with ZeroRedundancyOptimizer(Adam), a global batch of 12 whatever the
# world size (so 3 ranks and 2 ranks apply the same update), a commit every step. argv: the step
# to train to, and "crash" to end like a killed process once that step's snapshot is stored
# (os._exit: no exit hook, the arenas stay in shared memory). Prints the parameters and each
# rank's shard of the Adam state by global parameter index.
ZERO = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import efdl.backend.torch as efdl
    efdl.init(timeout=60)
    rank, world = efdl.get_rank(), efdl.get_world_size()
    steps, batch = int(sys.argv[1]), 12
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    state = efdl.State(model, zero, step=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(batch * 24, 16, generator=data)   # the same samples whatever `steps`
    y = torch.randint(0, 4, (batch * 24,), generator=data)
    per = batch // world
    while state.step < steps:
        lo = state.step * batch + rank * per
        loss = torch.nn.functional.cross_entropy(ddp(x[lo:lo + per]), y[lo:lo + per])
        zero.zero_grad()
        loss.backward()
        zero.step()
        state.step += 1
        state.commit()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    shard = {index[id(p)]: [int(s["step"]), s["exp_avg"].flatten().tolist(),
                            s["exp_avg_sq"].flatten().tolist()]
             for p, s in zero.optim.state.items()}
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"rank": rank, "step": state.step, "shard": shard,
                                  "params": params}), flush=True)
    if sys.argv[2:] == ["crash"]:
        state.flush()
        os._exit(0)
""")


def node_env(tmp_path, job, node, storage="storage"):
    """Rank `node` plays a node of its own: its own shared memory; `storage`: the job's
    snapshot store (shared by the nodes unless told otherwise)."""
    shm = tmp_path / job / ("shm-%d" % node)
    shm.mkdir(parents=True, exist_ok=True)
    return {"EFDL_JOB_ID": job + "-" + tmp_path.name, "EFDL_SHM_DIR": str(shm),
            "EFDL_SNAPSHOT_DIR": str(tmp_path / job / storage), "EFDL_SNAPSHOT_PER_RANK": "1",
            "EFDL_PERSIST_MIN_INTERVAL_MS": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def run_zero(tmp_path, spawn_ranks, job, world, steps, crash=False, storage=None):
    storage = storage or (lambda r: "storage")
    results = spawn_ranks([PYTHON, "-c", ZERO, str(steps)] + (["crash"] if crash else []),
                          world, timeout=120,
                          rank_env=lambda r: node_env(tmp_path, job, r, storage(r)))
    out = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(json.loads([ln for ln in r.stdout.splitlines()
                               if ln.startswith("RESULT ")][-1][7:]))
    return results, out


def assert_same(got, want, what):
    # The same samples at every step; the gradient's all-reduce over 3 ranks and over 2 sums in
    # another order, so values agree to float rounding (1e-6), not to the last bit - as in the
    # DDP tests of test_e2e_state.py. A lost or restarted step moves them by about 1e-3.
    g, w = torch.tensor(got), torch.tensor(want)
    assert torch.allclose(g, w, rtol=0, atol=1e-6), (what, (g - w).abs().max().item())


def assert_as_uninterrupted(out, ref, steps):
    """The job's parameters and whole Adam state (`out`: every rank's RESULT) equal those of the
    uninterrupted run `ref` after the same steps."""
    got, want = whole_state(out), whole_state(ref)
    assert sorted(got, key=int) == sorted(want, key=int)
    for i in want:
        assert want[i][0] == steps
        assert got[i][0] == want[i][0], ("Adam step count of parameter %s" % i, got[i][0])
        assert_same(got[i][1], want[i][1], "exp_avg of parameter %s" % i)
        assert_same(got[i][2], want[i][2], "exp_avg_sq of parameter %s" % i)
    for k, (g, w) in enumerate(zip(out[0]["params"], ref[0]["params"])):
        assert_same(g, w, "parameter %d" % k)


def test_zero_redundancy_optimizer_survives_world_size_changes_as_an_uninterrupted_run(
        tmp_path, spawn_ranks):
    # The uninterrupted runs: 2 ranks, no change, the same global batch at every step.
    _, ref10 = run_zero(tmp_path, spawn_ranks, "reference-10", 2, 10)
    _, ref14 = run_zero(tmp_path, spawn_ranks, "reference-14", 2, 14)
    _, ref16 = run_zero(tmp_path, spawn_ranks, "reference-16", 2, 16)

    # 3 nodes train to step 6 and are killed. Node 2 is lost with its shared memory; nodes 0
    # and 1 go on: old shards 0 and 1 from their own memory, old shard 2 from storage.
    run_zero(tmp_path, spawn_ranks, "job", 3, 6, crash=True)
    shutil.rmtree(tmp_path / "job" / "shm-2")
    results, out = run_zero(tmp_path, spawn_ranks, "job", 2, 10, crash=True)
    assert_as_uninterrupted(out, ref10, 10)
    logs = [r.stderr for r in results]
    for rank, log in enumerate(logs):
        line = [ln for ln in log.splitlines() if "restored its ZeroRedundancyOptimizer" in ln]
        assert len(line) == 1, log[-3000:]
        assert "of snapshot seq" in line[0] and "(step 6), written by 3 ranks, for 2 ranks" in \
            line[0], line[0]
        assert "old shard %d from this node's memory" % rank in line[0], line[0]
    everything = "\n".join(logs)
    assert "old shard 2 from storage" in everything, everything[-3000:]

    # A new node joins (empty memory, a snapshot store of its own): its rank gets its part of
    # every old shard over the network from the ranks that hold it in memory.
    results, out = run_zero(tmp_path, spawn_ranks, "job", 3, 14,
                            storage=lambda r: "storage-new" if r == 2 else "storage")
    line = [ln for ln in results[2].stderr.splitlines()
            if "restored its ZeroRedundancyOptimizer" in ln]
    assert len(line) == 1, results[2].stderr[-3000:]
    assert "(step 10), written by 2 ranks, for 3 ranks" in line[0], line[0]
    assert "over the network (from its node's memory)" in line[0], line[0]
    assert "; model and values from old shard 0 from rank 0 over the network" in line[0], line[0]

    assert_as_uninterrupted(out, ref14, 14)

    # One rank alone (a group of one) while old rank 2's shards are in a store it cannot see:
    # no snapshot is complete, and it says what is missing and what to do - not a fresh start.
    results = spawn_ranks([PYTHON, "-c", ZERO, "16"], 1, timeout=120,
                          rank_env=lambda r: node_env(tmp_path, "job", r))
    line = refusal(results[0])
    assert line.startswith("efdl._efdl.SnapshotError: job 'job-%s': the newest sharded snapshot "
                           "(seq " % tmp_path.name) and ", step 14, written by 3 ranks) lacks " \
        "the optimizer shard of old rank(s) 2: in no surviving rank's memory and in no " \
        "snapshot store a rank can read" in line and "give the new ranks the snapshot store " \
        "(EFDL_SNAPSHOT_DIR)" in line, line
    # Done as it says (old rank 2's store where the rank sees it): all 3 old shards from
    # storage into one rank, which ends as the uninterrupted run.
    job_id = "job-" + tmp_path.name
    shutil.rmtree(tmp_path / "job" / "storage" / job_id / "rank-2")
    shutil.copytree(tmp_path / "job" / "storage-new" / job_id / "rank-2",
                    tmp_path / "job" / "storage" / job_id / "rank-2")
    results, out = run_zero(tmp_path, spawn_ranks, "job", 1, 16)
    assert "written by 3 ranks, for 1 ranks: old shard 0 from storage" in results[0].stderr, \
        results[0].stderr[-3000:]
    assert_as_uninterrupted(out, ref16, 16)


def refusal(result):
    """The one line a rank's refused State(...) printed (the last of its traceback)."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "RESULT" not in result.stdout, result.stdout
    return result.stderr.strip().splitlines()[-1]


def test_zero_without_per_rank_snapshots_is_refused_with_one_line(tmp_path, spawn_ranks):
    results = spawn_ranks([PYTHON, "-c", ZERO, "2"], 2, timeout=120,
                          rank_env=lambda r: dict(node_env(tmp_path, "node-copy", r),
                                                  EFDL_SNAPSHOT_PER_RANK="0"))
    for r in results:
        line = refusal(r)
        assert line == ("TypeError: efdl.State holds a ZeroRedundancyOptimizer with per-rank "
                        "snapshots only: each rank keeps its own shard; set "
                        "EFDL_SNAPSHOT_PER_RANK=1 (under `efdl run`, in the environment of "
                        "`efdl run`, so the agents store every rank's shard)"), line
    assert not os.path.exists(tmp_path / "node-copy" / "storage")


# What the scripts below use to try one construction: out[name] is its TypeError's line, or
# "accepted".
ATTEMPT = textwrap.dedent("""
    out = {}

    def attempt(name, make):
        try:
            make()
            out[name] = "accepted"
        except TypeError as e:
            out[name] = str(e)
""")

# One rank in a gloo group (a ZeroRedundancyOptimizer needs one), per-rank snapshots: each
# attempt's error line, or "accepted". ZeroRedundancyOptimizer is accepted at construction, at
# the setter and through Horovod's TorchState; one State cannot restore is refused everywhere:
# built with overlap_with_ddp=True, over a process group of its own, and an unknown sharded
# optimizer (a mark of sharding: consolidate_state_dict(), as fairscale's OSS).
ATTEMPTS = textwrap.dedent("""
    import json
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import efdl.backend.torch as efdl
    import efdl.backend.horovod.torch as hvd
    efdl.init(timeout=60)
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))

    class OSS(torch.optim.SGD):
        def consolidate_state_dict(self, to=0):
            pass
""") + ATTEMPT + textwrap.dedent("""
    zero_adam = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=0.01)
    zero_sgd = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       lr=0.1, momentum=0.9)
    overlap = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      overlap_with_ddp=True, lr=0.01)
    own_group = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                        process_group=dist.new_group([0]), lr=0.01)
    oss = OSS(model.parameters(), lr=0.1)
    attempt("zero_adam", lambda: efdl.State(model, zero_adam, step=0))
    attempt("zero_sgd_positional", lambda: efdl.State(model, zero_sgd, None))
    attempt("hvd_torch_state", lambda: hvd.elastic.TorchState(model, zero_adam, epoch=0))
    attempt("overlap", lambda: efdl.State(model, overlap, step=0))
    attempt("own_group", lambda: efdl.State(model, own_group, step=0))
    attempt("oss", lambda: efdl.State(model, oss, step=0))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    state = efdl.State(model, adam, step=0)
    attempt("setter_oss", lambda: setattr(state, "optimizer", oss))
    attempt("set_and_restore_overlap", lambda: state.set_and_restore_optimizer(overlap))
    out["kept"] = state.optimizer is adam
    attempt("setter_zero", lambda: setattr(state, "optimizer", zero_adam))
    out["set"] = state.optimizer is zero_adam
    attempt("adam", lambda: efdl.State(model, adam, step=0))
    dist_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    attempt("hvd_distributed_optimizer", lambda: hvd.elastic.TorchState(model, dist_opt, epoch=0))
    print("RESULT " + json.dumps(out))
""")


def test_sharded_optimizers_state_cannot_restore_are_refused_everywhere(tmp_path, spawn_ranks):
    (r,) = spawn_ranks([PYTHON, "-c", ATTEMPTS], 1, timeout=90,
                       rank_env=lambda r: node_env(tmp_path, "attempts", r))
    assert r.returncode == 0, r.stderr
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for name in ("zero_adam", "zero_sgd_positional", "hvd_torch_state", "setter_zero", "adam",
                 "hvd_distributed_optimizer"):
        assert out[name] == "accepted", (name, out[name])
    assert out["set"] is True
    for name, text in [
            ("overlap", "efdl.State cannot hold a ZeroRedundancyOptimizer: it was built with "
                        "overlap_with_ddp=True"),
            ("set_and_restore_overlap", "efdl.State cannot hold a ZeroRedundancyOptimizer: it "
                                        "was built with overlap_with_ddp=True"),
            ("own_group", "efdl.State holds a ZeroRedundancyOptimizer over the default process "
                          "group only"),
            ("oss", "efdl.State cannot hold an OSS: it shards the optimizer state (it has "
                    "consolidate_state_dict())"),
            ("setter_oss", "efdl.State cannot hold an OSS: it shards the optimizer state")]:
        assert out[name].startswith(text), (name, out[name])
        assert "\n" not in out[name], (name, out[name])
        if name != "own_group":
            assert SUPPORTED in out[name] and "ZeroRedundancyOptimizer with " \
                "EFDL_SNAPSHOT_PER_RANK=1" in out[name], (name, out[name])
    assert out["kept"] is True, "a refused setter leaves the optimizer State had"


# Horovod's state.restore() (back to the newest snapshot this node holds, no agreement) with a
# ZeroRedundancyOptimizer: the rank's own shard of the same layout comes back.
HVD_RESTORE = textwrap.dedent("""
    import json
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import efdl.backend.torch as efdl
    import efdl.backend.horovod.torch as hvd
    efdl.init(timeout=60)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                   lr=0.01)
    state = hvd.elastic.TorchState(model, zero, step=0)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        zero.step()
        zero.zero_grad()
        state.step += 1
        state.commit()
    saved = [(int(s["step"]), s["exp_avg"].clone()) for s in zero.optim.state.values()]
    for s in zero.optim.state.values():   # what a failed step might leave behind
        s["exp_avg"].add_(1.0)
        s["step"] += 5
    state.restore()
    back = [(int(s["step"]), s["exp_avg"]) for s in zero.optim.state.values()]
    print("RESULT " + json.dumps({
        "n": len(back), "steps": [b[0] for b in back],
        "same": len(back) == len(saved) and all(
            a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(saved, back))}))
""")


def test_horovod_restore_brings_back_the_rank_s_own_zero_shard(tmp_path, spawn_ranks):
    (r,) = spawn_ranks([PYTHON, "-c", HVD_RESTORE], 1, timeout=90,
                       rank_env=lambda r: node_env(tmp_path, "hvd-restore", r))
    assert r.returncode == 0, r.stderr
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert out == {"n": 4, "steps": [3, 3, 3, 3], "same": True}, out


# -- in this process: no process group needed ---------------------------------------------------

@pytest.fixture
def job(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EFDL_CONTROL_SOCKET",
                "EFDL_SNAPSHOT_PER_RANK", "EFDL_AGENT_PERSISTS"):
        monkeypatch.delenv(var, raising=False)
    env = {"EFDL_JOB_ID": "sharded-" + tmp_path.name, "EFDL_SNAPSHOT_DIR": str(tmp_path / "snaps"),
           "EFDL_SHM_DIR": str(tmp_path / "shm"), "EFDL_RESTORE_OTHER_PROGRAM": "1"}
    os.makedirs(env["EFDL_SHM_DIR"])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as it is often written: the fast weights' state lives in the
    optimizer it wraps, its own `state` holds the slow weights only."""

    def __init__(self, base, k=5, alpha=0.5):
        self.base = base
        super().__init__(base.param_groups, dict(k=k, alpha=alpha))
        self.param_groups = base.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("slow", p.detach().clone())
                st["count"] = st.get("count", 0) + 1
                if st["count"] % group.get("k", 5) == 0:
                    st["slow"].add_(p - st["slow"], alpha=group.get("alpha", 0.5))
                    p.copy_(st["slow"])
        return loss


class Shared(torch.optim.Optimizer):
    """A wrapper whose state *is* its inner optimizer's (as torch's PostLocalSGDOptimizer)."""

    def __init__(self, inner):
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None):
        return self.inner.step(closure)


class HandRolled:
    """An optimizer that is no torch.optim.Optimizer (as DeepSpeed's ZeRO optimizers are not)."""

    def __init__(self, params):
        self.param_groups = [{"params": list(params), "lr": 0.1}]
        self.state = {}


def test_optimizers_state_cannot_see_are_refused_with_one_line(job):
    model = torch.nn.Linear(4, 2)
    for opt, text in [
            (HandRolled(model.parameters()),
             "efdl.State cannot hold a HandRolled: it is not a torch.optim.Optimizer"),
            (Lookahead(torch.optim.Adam(model.parameters())),
             "efdl.State cannot hold a Lookahead: it keeps optimizer state in the Adam it wraps "
             "(attribute 'base'), which State does not snapshot")]:
        with pytest.raises(TypeError) as e:
            State(model, opt, step=0)
        assert str(e.value).startswith(text), str(e.value)
        assert "\n" not in str(e.value) and SUPPORTED in str(e.value)
    assert os.listdir(job["EFDL_SHM_DIR"]) == [], "refused before anything was opened"


def test_every_torch_optimizer_and_a_wrapper_sharing_its_state_are_accepted(job):
    model = torch.nn.Linear(4, 2)
    classes = [c for c in vars(torch.optim).values()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
               and c is not torch.optim.Optimizer]
    assert len(classes) >= 10, classes
    for cls in classes:
        _parts.check_optimizer(cls(model.parameters(), lr=0.01))
    state = State(model, Shared(torch.optim.Adam(model.parameters())), step=0)
    state.commit()


FSDP = textwrap.dedent("""
    import json, torch
    import efdl.backend.torch as efdl
    efdl.init(timeout=60)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    kw = {"device_id": torch.cuda.current_device()} if torch.cuda.is_available() else {}
    outer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    inner = torch.nn.Sequential(FSDP(torch.nn.Linear(4, 3), **kw), torch.nn.Linear(3, 2))
""") + ATTEMPT + textwrap.dedent("""
    wrapped = FSDP(outer, **kw)
    attempt("fsdp_model", lambda: efdl.State(wrapped, step=0))
    attempt("fsdp_submodule", lambda: efdl.State(inner, step=0))
    attempt("fsdp_optimizer", lambda: efdl.State(None, torch.optim.Adam(wrapped.parameters())))
    print("RESULT " + json.dumps(out))
""")


def test_fsdp_models_and_optimizers_over_them_are_refused(tmp_path, spawn_ranks):
    probe = spawn_ranks([PYTHON, "-c", "import torch.distributed.fsdp"], 1, timeout=60)[0]
    if probe.returncode != 0:
        pytest.skip("torch.distributed.fsdp does not import in this torch (%s): %s" % (
            torch.__version__, probe.stderr.strip().splitlines()[-1]))
    (r,) = spawn_ranks([PYTHON, "-c", FSDP], 1, timeout=90,
                       rank_env=lambda r: node_env(tmp_path, "fsdp", r))
    assert r.returncode == 0, r.stderr
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert out["fsdp_model"].startswith(
        "efdl.State cannot hold a model wrapped in FullyShardedDataParallel"), out
    assert out["fsdp_submodule"].startswith(
        "efdl.State cannot hold a model whose submodule '0' is a FullyShardedDataParallel"), out
    assert out["fsdp_optimizer"].startswith(
        "efdl.State cannot hold an Adam over FlatParameter parameters"), out
    assert all(SUPPORTED in v and "\n" not in v for v in out.values()), out
