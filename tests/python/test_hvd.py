"""EFDL's Horovod-API layer over torch.distributed (efdl.backend.horovod.torch without Horovod).

The multi-rank checks run in one spawn of 3 local ranks (a gloo group on loopback), laid out as
two nodes (ranks 0,1 on one, rank 2 on the other); each rank prints one JSON line of results.
Run as a script, this file is that rank's program.
"""

import json
import os
import subprocess
import textwrap

import pytest

from conftest import PYTHON, kill_all, run_ranks

THIS_FILE = os.path.abspath(__file__)


# ---- the rank program ----------------------------------------------------------------------------

def _model(torch, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()


def _data(torch, rank, step, rows):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=g))


def _flat(torch, model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_distributed(hvd, torch, steps, rows, passes=1, op=None, compression=None):
    """Ranks start from different weights; broadcast from rank 0; train on their own data."""
    model = _model(torch, seed=100 + hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    kwargs = {"named_parameters": model.named_parameters(), "backward_passes_per_step": passes}
    if op is not None:
        kwargs["op"] = op
    if compression is not None:
        kwargs["compression"] = compression
    opt = hvd.DistributedOptimizer(opt, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        opt.zero_grad()
        for p in range(passes):
            x, y = _data(torch, hvd.rank(), step * passes + p, rows)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _train_reference(torch, world, steps, rows, passes=1, summed=False):
    """One process, the union of every rank's data: the loss whose gradient the ranks' averaged
    (or summed) gradients must equal."""
    model = _model(torch, seed=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        loss = 0
        for p in range(passes):
            for r in range(world):
                x, y = _data(torch, r, step * passes + p, rows)
                loss = loss + torch.nn.functional.cross_entropy(model(x), y)
        (loss if summed else loss / world).backward()
        opt.step()
    return model


def rank_program():
    import torch
    from efdl.backend.horovod.torch import hvd
    import efdl.backend.horovod.torch as efdl

    out = {"before": [efdl.get_rank(), efdl.get_world_size(), efdl.get_local_rank()]}
    efdl.init(timeout=60)
    rank, size = hvd.rank(), hvd.size()
    out["layout"] = [rank, size, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                     hvd.cross_size(), hvd.is_homogeneous()]

    def diff(a, b):
        return float((a - b).abs().max())

    ref = _flat(torch, _train_reference(torch, size, steps=4, rows=8))
    got = _flat(torch, _train_distributed(hvd, torch, steps=4, rows=8))
    out["average_vs_union"] = diff(got, ref)
    out["params"] = got.tolist()
    ref2 = _flat(torch, _train_reference(torch, size, steps=3, rows=4, passes=2))
    got2 = _flat(torch, _train_distributed(hvd, torch, steps=3, rows=4, passes=2))
    out["passes2_vs_union"] = diff(got2, ref2)
    ref_sum = _flat(torch, _train_reference(torch, size, steps=2, rows=8, summed=True))
    got_sum = _flat(torch, _train_distributed(hvd, torch, steps=2, rows=8, op=hvd.Sum))
    out["sum_vs_union"] = diff(got_sum, ref_sum)
    got16 = _flat(torch, _train_distributed(hvd, torch, steps=4, rows=8,
                                            compression=hvd.Compression.fp16))
    out["fp16_vs_union"] = diff(got16, ref)

    # Optimizer state: rank 0 holds momentum from a local step, the others start empty.
    model = _model(torch, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:
        model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.05
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    bufs = [opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()]
    out["momentum"] = torch.cat(bufs).tolist()
    out["lr"] = opt.param_groups[0]["lr"]

    # An LR scheduler made before the optimizer is distributed (it wraps optimizer.step on the
    # object): the step must still average, and still count for the scheduler.
    model = _model(torch, seed=11)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model(torch.full((2, 6), float(rank + 1), dtype=torch.float64)).sum().backward()
    opt.step()
    sched.step()
    out["scheduler_first"] = [_flat(torch, model).tolist(), opt._step_count,
                              opt.param_groups[0]["lr"]]

    t = torch.tensor([float(rank + 1), -float(rank)])
    out["allreduce_avg"] = hvd.allreduce(t).tolist()
    out["allreduce_sum"] = hvd.allreduce(t, op=hvd.Sum).tolist()
    out["allreduce_min_max"] = [hvd.allreduce(t, op=hvd.Min).tolist(),
                                hvd.allreduce(t, op=hvd.Max).tolist()]
    out["input_untouched"] = t.tolist()
    inplace = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    hvd.allreduce_(inplace, op=hvd.Sum)
    out["allreduce_inplace_noncontig"] = inplace.tolist()
    scaled = hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    out["allreduce_scaled"] = scaled.tolist()
    handle = hvd.allreduce_async(torch.full((3,), float(rank)), op=hvd.Sum)
    out["async"] = hvd.synchronize(handle).tolist()
    out["poll_after"] = hvd.poll(handle)
    out["grouped"] = [x.tolist() for x in hvd.grouped_allreduce([torch.ones(1), torch.ones(2)])]
    out["allgather"] = hvd.allgather(torch.full((rank + 1, 2), rank)).tolist()
    out["broadcast"] = hvd.broadcast(torch.tensor([rank * 10.0]), root_rank=2).tolist()
    b = torch.tensor([rank * 1.0, 5.0])
    hvd.broadcast_(b, root_rank=1)
    out["broadcast_"] = b.tolist()
    out["broadcast_object"] = hvd.broadcast_object({"from": rank, "v": [1, 2]}, root_rank=1)
    out["allgather_object"] = hvd.allgather_object(("r", rank))
    hvd.barrier()
    out["join"] = hvd.join()
    hvd.shutdown()
    out["after_shutdown"] = hvd.is_initialized()
    print("RESULT " + json.dumps(out), flush=True)


# ---- the tests ---------------------------------------------------------------------------------

def two_node_layout(rank):
    """Ranks 0, 1 on node A (local ranks 0, 1), rank 2 alone on node B."""
    return {0: dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"),
            1: dict(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"),
            2: dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")}[rank]


@pytest.fixture(scope="module")
def three_ranks():
    started = []
    try:
        results = run_ranks([PYTHON, THIS_FILE], 3, started, timeout=240,
                            rank_env=two_node_layout, env=dict(EFDL_HOROVOD="torch"))
    finally:
        kill_all(started)
    outs = []
    for rank, proc in enumerate(results):
        assert proc.returncode == 0, "rank %d failed:\n%s" % (rank, proc.stderr[-3000:])
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        assert line, proc.stdout
        outs.append(json.loads(line[0][len("RESULT "):]))
    return outs


def test_ranks_with_different_data_end_equal_to_one_process_on_the_union(three_ranks):
    for out in three_ranks:
        assert out["average_vs_union"] < 1e-9
        assert out["passes2_vs_union"] < 1e-9
        assert out["sum_vs_union"] < 1e-9
        assert out["fp16_vs_union"] < 5e-2
    assert three_ranks[0]["params"] == three_ranks[1]["params"] == three_ranks[2]["params"]


def test_layout_follows_the_nodes(three_ranks):
    layouts = [out["layout"] for out in three_ranks]
    # rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous
    assert layouts == [[0, 3, 0, 2, 0, 2, False], [1, 3, 1, 2, 0, 1, False],
                       [2, 3, 0, 1, 1, 2, False]]
    assert [out["before"] for out in three_ranks] == [[0, 3, 0], [1, 3, 1], [2, 3, 0]]


def test_scheduler_made_before_distributing_the_optimizer_does_not_skip_averaging(three_ranks):
    # Every rank stepped on its own data: equal parameters only if the gradients were averaged.
    params = [o["scheduler_first"][0] for o in three_ranks]
    assert params[0] == params[1] == params[2]
    assert [o["scheduler_first"][1:] for o in three_ranks] == [[1, 0.05]] * 3


def test_optimizer_state_and_hyperparameters_come_from_the_root(three_ranks):
    assert three_ranks[0]["lr"] == three_ranks[1]["lr"] == three_ranks[2]["lr"] == 0.05
    assert three_ranks[1]["momentum"] == three_ranks[0]["momentum"] == three_ranks[2]["momentum"]
    assert any(v != 0 for v in three_ranks[0]["momentum"])


def test_collectives_give_horovods_results(three_ranks):
    for rank, out in enumerate(three_ranks):
        assert out["allreduce_avg"] == [2.0, -1.0]
        assert out["allreduce_sum"] == [6.0, -3.0]
        assert out["allreduce_min_max"] == [[1.0, -2.0], [3.0, 0.0]]
        assert out["input_untouched"] == [rank + 1.0, -float(rank)]
        assert out["allreduce_inplace_noncontig"] == [[0.0, 9.0], [3.0, 12.0], [6.0, 15.0]]
        assert out["allreduce_scaled"] == [3.0, 3.0]
        assert out["async"] == [3.0, 3.0, 3.0] and out["poll_after"] is True
        assert out["grouped"] == [[1.0], [1.0, 1.0]]
        assert out["allgather"] == [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
        assert out["broadcast"] == [20.0]
        assert out["broadcast_"] == [1.0, 5.0]
        assert out["broadcast_object"] == {"from": 1, "v": [1, 2]}
        assert out["allgather_object"] == [["r", 0], ["r", 1], ["r", 2]]
        assert out["after_shutdown"] is False
    joins = {out["join"] for out in three_ranks}
    assert len(joins) == 1 and joins <= {0, 1, 2}


SINGLE = textwrap.dedent("""
    import json, torch
    from efdl.backend.horovod.torch import hvd
    import efdl.backend.horovod.torch as efdl
    errors = {}
    def expect(name, fn, kind):
        try:
            fn()
            errors[name] = "no error"
        except kind as e:
            errors[name] = str(e)
    expect("before_init", hvd.size, ValueError)
    hvd.init()
    m = torch.nn.Linear(2, 1)
    expect("adasum", lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum), NotImplementedError)
    expect("adasum_opt", lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), 0.1),
                                                          op=hvd.Adasum), NotImplementedError)
    expect("dup_names", lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), 0.1),
        named_parameters=[("w", m.weight), ("w", m.bias)]), ValueError)
    expect("unnamed", lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), 0.1),
        named_parameters=[("w", m.weight)]), ValueError)
    expect("comm", lambda: hvd.init(comm=[0]), NotImplementedError)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    wrapped = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())
    m(torch.ones(1, 2)).sum().backward()
    wrapped.synchronize()
    with wrapped.skip_synchronize():
        wrapped.step()
    print("RESULT " + json.dumps(dict(errors=errors, same=wrapped is opt, size=hvd.size(),
        rank=efdl.get_rank(), world=efdl.get_world_size(), sampler=efdl.data.DistributedSampler(
        range(5)).num_replicas, native=efdl.NATIVE)))
""")


def test_single_process_api_and_clear_errors(clean_env):
    env = dict(clean_env, EFDL_HOROVOD="torch")
    proc = subprocess.run([PYTHON, "-c", SINGLE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    errors = out["errors"]
    assert errors["before_init"] == "Horovod has not been initialized; use hvd.init()."
    assert "Adasum is not supported" in errors["adasum"]
    assert "Adasum is not supported" in errors["adasum_opt"]
    assert "must be unique" in errors["dup_names"] and "w" in errors["dup_names"]
    assert "were not named" in errors["unnamed"]
    assert "MPI communicators" in errors["comm"]
    assert out["same"] is True
    assert (out["size"], out["rank"], out["world"], out["sampler"]) == (1, 0, 1, 1)
    assert out["native"] is False


SELECTION = textwrap.dedent("""
    import importlib, json, os, sys, warnings
    base = dict(os.environ)
    results = []
    for case in json.loads(sys.argv[1]):
        os.environ.clear(); os.environ.update(base); os.environ.update(case)
        for name in [m for m in sys.modules if m.startswith("efdl.backend.horovod")]:
            del sys.modules[name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                e = importlib.import_module("efdl.backend.horovod.torch")
                results.append([e.hvd.__name__, e.NATIVE, [str(w.message) for w in caught]])
            except ImportError as error:
                results.append(["ImportError", str(error)])
    print("RESULT " + json.dumps(results))
""")


def test_real_horovod_is_chosen_only_when_it_can_join_the_job(clean_env, tmp_path):
    # Horovod cannot be installed here; a stand-in package only shows which module `hvd` is.
    package = tmp_path / "horovod"
    (package / "torch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "torch" / "__init__.py").write_text("")
    env = dict(clean_env, PYTHONPATH=str(tmp_path) + os.pathsep + clean_env["PYTHONPATH"])
    multi = dict(RANK="0", WORLD_SIZE="2")
    hvd_env = dict(multi, HOROVOD_RANK="0", HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1")
    cases = [{}, dict(EFDL_HOROVOD="torch"), hvd_env, multi, dict(multi, EFDL_HOROVOD="native")]
    proc = subprocess.run([PYTHON, "-c", SELECTION, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    single, forced, served, unserved, native = json.loads(proc.stdout.split("RESULT ", 1)[1])
    layer = "efdl.backend.horovod.torch._layer"
    assert single == ["horovod.torch", True, []]
    assert forced == [layer, False, []]
    assert served == ["horovod.torch", True, []]
    assert unserved[:2] == [layer, False] and "would train each worker alone" in unserved[2][0]
    assert native[0] == "ImportError" and "EFDL_HOROVOD=native" in native[1]


MODULE_IS_HVD = textwrap.dedent("""
    import json, sys
    import efdl.backend.horovod.torch as module
    from efdl.backend.horovod.torch import hvd
    names = list(hvd.__all__) + ["elastic", "HorovodInternalError", "HostsUpdatedInterrupt"]
    differ = [n for n in names if n != "init" and getattr(module, n) is not getattr(hvd, n)]
    elastic = [getattr(module.elastic, n) is getattr(hvd.elastic, n)
               for n in ("run", "TorchState", "ElasticSampler")]
    module.init()
    print("RESULT " + json.dumps([differ, elastic, module.size(), module.rank(),
                                  module.is_initialized(), "size" in dir(module)]))
""")


def test_the_module_is_the_whole_horovod_api(clean_env):
    # `import efdl.backend.horovod.torch as hvd` (#34): every name of Horovod's API the docs list
    # is the very object of the older `from efdl.backend.horovod.torch import hvd`.
    proc = subprocess.run([PYTHON, "-c", MODULE_IS_HVD], env=clean_env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    differ, elastic, size, rank, initialized, listed = json.loads(
        proc.stdout.split("RESULT ", 1)[1])
    assert differ == [] and elastic == [True, True, True]
    assert [size, rank, initialized, listed] == [1, 0, True, True]


SHIM_PROGRAM = textwrap.dedent("""
    import json
    import horovod
    import horovod.torch as hvd
    import horovod.torch.elastic
    import efdl.backend.horovod.torch as module
    hvd.init()
    print("RESULT " + json.dumps([hvd.__name__, hvd.size is module.size,
                                  hvd.DistributedOptimizer is module.DistributedOptimizer,
                                  hvd.elastic is module.elastic,
                                  horovod.torch.elastic is module.elastic, module.NATIVE,
                                  hvd.size(), horovod.__version__]))
""")


def test_the_horovod_stand_in_is_efdls_layer_and_refuses_a_real_horovod(clean_env, tmp_path):
    # What `efdl run --horovod` puts in front of the workers' PYTHONPATH (#34).
    import efdl.backend.horovod as backend
    env = dict(clean_env, PYTHONPATH=backend.SHIM_DIR + os.pathsep + clean_env["PYTHONPATH"])
    proc = subprocess.run([PYTHON, "-c", SHIM_PROGRAM], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.split("RESULT ", 1)[1]) == [
        "horovod.torch", True, True, True, True, False, 1, "0+efdl"]
    # A real Horovod later on the path: the stand-in refuses, in one line.
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    proc = subprocess.run([PYTHON, "-c", "import horovod.torch"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: efdl run --horovod: a real Horovod is installed (%s"
                           % tmp_path), proc.stderr


def test_horovod_backend_offers_the_torch_backends_state():
    import efdl.backend.horovod.torch as hvd_backend
    import efdl.backend.torch as torch_backend
    try:
        expected = torch_backend.State
    except (AttributeError, ImportError) as e:
        pytest.skip("efdl.backend.torch.State is not available here: %s" % e)
    assert hvd_backend.State is expected


@pytest.mark.parametrize("module", ["efdl.backend.horovod.tensorflow",
                                    "efdl.backend.horovod.tensorflow.keras"])
def test_tensorflow_backends_without_horovod_say_what_to_install(clean_env, module):
    proc = subprocess.run([PYTHON, "-c", "import " + module], env=clean_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "pip install horovod" in last


def test_native_choice_without_horovod_fails_clearly(clean_env):
    proc = subprocess.run([PYTHON, "-c", "import efdl.backend.horovod.torch"],
                          env=dict(clean_env, EFDL_HOROVOD="native"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "horovod.torch is not importable" in proc.stderr.strip().splitlines()[-1]


if __name__ == "__main__":
    rank_program()
