"""efdl.State and sharded state (issue #35, first step): what State cannot restore across a
world-size change is refused at State(...) with one TypeError line, instead of being corrupted.

The reproduction, the way a user tried it: a ZeroRedundancyOptimizer(Adam) program under State
on 3 ranks, then on 2 after a world-size change. Each rank holds only its shard of the Adam
state, and State snapshots replicated state (optimizer.state: a ZeroRedundancyOptimizer keeps
its shard in the optimizer it wraps). Before the refusal the job finished without a warning,
with every rank's Adam state started over at the change: step counts of 4 where an uninterrupted
2-rank run of the same program counts 10 (the issue saw 59 against 276). Now the same program
stops at State(...) on every rank, before anything is trained or written. The rest: the other refusals (FSDP, optimizers State knows nothing of), Horovod's
TorchState (an efdl.State), the setters, and the optimizers State keeps accepting.
"""

import json
import os
import textwrap

import pytest
import torch

from conftest import PYTHON

from efdl import _parts
from efdl.state import State

SUPPORTED = "State snapshots and restores replicated state only"

# A small MLP under DDP with ZeroRedundancyOptimizer(Adam), a global batch of 12 whatever the
# world size (so 3 ranks and 2 ranks apply the same update), a commit every step. argv: the step
# to train to. Prints each rank's shard of the Adam state by parameter index (it did, until State
# refused the ZeroRedundancyOptimizer: the step counts compared with an uninterrupted run).
ZERO = textwrap.dedent("""
    import json, sys
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
    x = torch.randn(batch * steps, 16, generator=data)
    y = torch.randint(0, 4, (batch * steps,), generator=data)
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
    shard = {index[id(p)]: [int(s["step"]), s["exp_avg"].flatten().tolist()]
             for p, s in zero.optim.state.items()}
    print("RESULT " + json.dumps({"rank": rank, "step": state.step, "shard": shard}))
""")


def node_env(tmp_path, job, node):
    """Rank `node` plays a node of its own: its own shared memory, storage of the job."""
    shm = tmp_path / job / ("shm-%d" % node)
    shm.mkdir(parents=True, exist_ok=True)
    return {"EFDL_JOB_ID": job + "-" + tmp_path.name, "EFDL_SHM_DIR": str(shm),
            "EFDL_SNAPSHOT_DIR": str(tmp_path / job / "storage"),
            "EFDL_PERSIST_MIN_INTERVAL_MS": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def run_zero(tmp_path, spawn_ranks, job, world, steps):
    return spawn_ranks([PYTHON, "-c", ZERO, str(steps)], world, timeout=120,
                       rank_env=lambda r: node_env(tmp_path, job, r))


def refusal(result):
    """The one line a rank's refused State(...) printed (the last of its traceback)."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "RESULT" not in result.stdout, result.stdout
    return result.stderr.strip().splitlines()[-1]


def test_zero_redundancy_optimizer_is_refused_not_corrupted_by_a_world_size_change(
        tmp_path, spawn_ranks):
    for world in (3, 2):                   # the job before and after the world-size change
        for r in run_zero(tmp_path, spawn_ranks, "elastic", world, 6 if world == 3 else 10):
            line = refusal(r)
            assert line.startswith("TypeError: efdl.State cannot hold a "
                                   "ZeroRedundancyOptimizer: it shards the optimizer state"), line
            assert "a rank's old shard is not the one the new layout gives it" in line, line
            assert SUPPORTED in line and "DistributedDataParallel" in line, line
    # Refused before anything was opened: no snapshot in any node's memory or in storage.
    job_dir = tmp_path / "elastic"
    assert not os.path.exists(job_dir / "storage"), os.listdir(job_dir / "storage")
    for node in range(3):
        assert os.listdir(job_dir / ("shm-%d" % node)) == []


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

# One rank in a gloo group (a ZeroRedundancyOptimizer needs one): each attempt's error line, or
# "accepted"; the sharded optimizers refused at construction, at the setter and through
# Horovod's TorchState; the replicated ones (also Horovod's DistributedOptimizer) accepted.
ATTEMPTS = textwrap.dedent("""
    import json
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import efdl.backend.torch as efdl
    import efdl.backend.horovod.torch as hvd
    efdl.init(timeout=60)
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
""") + ATTEMPT + textwrap.dedent("""
    zero_adam = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=0.01)
    zero_sgd = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       lr=0.1, momentum=0.9)
    attempt("zero_adam", lambda: efdl.State(model, zero_adam, step=0))
    attempt("zero_sgd_positional", lambda: efdl.State(model, zero_sgd, None))
    attempt("hvd_torch_state", lambda: hvd.elastic.TorchState(model, zero_adam, epoch=0))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    state = efdl.State(model, adam, step=0)
    attempt("setter", lambda: setattr(state, "optimizer", zero_adam))
    attempt("set_and_restore", lambda: state.set_and_restore_optimizer(zero_sgd))
    out["kept"] = state.optimizer is adam
    attempt("adam", lambda: efdl.State(model, adam, step=0))
    dist_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    attempt("hvd_distributed_optimizer", lambda: hvd.elastic.TorchState(model, dist_opt, epoch=0))
    print("RESULT " + json.dumps(out))
""")


def test_sharded_optimizers_are_refused_everywhere_state_takes_one(tmp_path, spawn_ranks):
    (r,) = spawn_ranks([PYTHON, "-c", ATTEMPTS], 1, timeout=90,
                       rank_env=lambda r: node_env(tmp_path, "attempts", r))
    assert r.returncode == 0, r.stderr
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for name in ("zero_adam", "zero_sgd_positional", "hvd_torch_state", "setter",
                 "set_and_restore"):
        assert out[name].startswith("efdl.State cannot hold a ZeroRedundancyOptimizer: it "
                                    "shards the optimizer state (it has consolidate_state_dict())"
                                    ), (name, out[name])
        assert "\n" not in out[name] and SUPPORTED in out[name], (name, out[name])
    assert out["kept"] is True, "a refused setter leaves the optimizer State had"
    assert out["adam"] == "accepted" and out["hvd_distributed_optimizer"] == "accepted", out


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
