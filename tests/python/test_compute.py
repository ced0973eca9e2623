"""Each rank's compute time per step (efdl/_compute.py; issue #32 part 3, straggler detection).

Two gloo ranks train the digits-sized MLP under DistributedDataParallel; rank 1 sleeps 100 ms
per step before its forward pass. The measured compute time (previous backward's end to this
step's gradients ready) is long on rank 1 and short on rank 0, which waits in the all-reduce
instead; the step time itself is the same on both. The gradient hooks change nothing: a model
trained with them ends bit-identical to its twin trained without, also when DDP wraps the
model before the watch and when the program registered a communication hook of its own.
"""

import os
import statistics
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python"))
from cluster import free_port  # noqa: E402 (tests/python/workers, on sys.path from conftest.py)

STEPS = 12
SLOW_S = 0.1


def _train(rank, model, watch, sink, hook=False, slow=0.0):
    import time
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from efdl import _compute
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if watch:
        _compute.watch(ddp, sink)   # the wrapper: its inner module's parameters are watched
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        if slow:
            time.sleep(slow)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _worker(rank, port, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=2)
    slow = SLOW_S if rank == 1 else 0.0
    times = []
    plain = _train(rank, _model(), False, None, slow=slow)
    watched = _train(rank, _model(), True, times.append, slow=slow)
    plain_hook = _train(rank, _model(), False, None, hook=True)
    hooked = _train(rank, _model(), True, lambda ns: None, hook=True)
    out.put((rank, times, plain == watched, plain_hook == hooked))
    dist.destroy_process_group()


def _two_ranks(target):
    """Runs target(rank, port, queue) in two spawned processes; returns {rank: what it put}
    (each puts (rank, ...))."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict((r, rest) for r, *rest in [out.get(timeout=120) for _ in procs])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_compute_time_is_per_rank_and_the_hooks_change_no_result():
    results = _two_ranks(_worker)
    for rank in (0, 1):
        times, same, same_hooked = results[rank]
        assert same, "rank %d: the watched model differs from its twin trained without" % rank
        assert same_hooked, "rank %d: with the program's comm hook, the results differ" % rank
        # Every backward after the first is measured.
        assert len(times) == STEPS - 1, (rank, len(times))
    fast = statistics.median(results[0][0]) / 1e9
    slow = statistics.median(results[1][0]) / 1e9
    print("median compute per step: rank 0 %.4f s, rank 1 (sleeps %.2f s) %.4f s" % (
        fast, SLOW_S, slow))
    assert slow >= SLOW_S * 0.9, slow
    assert fast < SLOW_S / 2, fast


def test_watch_is_once_per_model_and_nothing_outside_efdl_run(monkeypatch):
    from efdl import _compute, _progress
    from efdl._names import Env
    model = _model()
    got = []
    t = _compute.watch(model, got.append)
    assert _compute.watch(model, got.append) is t
    assert _compute.watch(torch.nn.ReLU(), got.append) is None   # no parameters
    t.detach()
    # Outside `efdl run` (no progress board) State's watch adds no hook.
    monkeypatch.delenv(Env.PROGRESS_BOARD, raising=False)
    other = _model()
    _progress.watch_compute(other)
    assert all(not p._backward_hooks for p in other.parameters())


def test_a_backward_pass_that_raised_does_not_end_the_measurement():
    """A backward pass that raises (after some gradient hooks fired) never runs its engine
    callbacks; the next forward pass starts the count again, so later steps are measured."""
    from efdl import _compute

    class Boom(torch.autograd.Function):
        fail = [False]

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if Boom.fail[0]:
                Boom.fail[0] = False
                raise RuntimeError("boom")
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.b(Boom.apply(self.a(x)))   # b's hooks fire before Boom raises

    net, times = Net(), []
    t = _compute.watch(net, times.append)
    x = torch.randn(3, 4)
    net(x).sum().backward()          # the first: nothing before it to measure from
    Boom.fail[0] = True
    with pytest.raises(RuntimeError, match="boom"):
        net(x).sum().backward()
    net(x).sum().backward()
    net(x).sum().backward()
    t.detach()
    assert len(times) == 2, times


def _hvd_worker(rank, port, out):
    """The Horovod layer reduces the gradients in optimizer.step(), outside backward: its waits
    for peers are taken off the compute time (efdl._compute.waited)."""
    import time
    import torch.distributed as dist
    import torch.nn.functional as F
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=2)
    import efdl.backend.horovod.torch as hvd
    from efdl import _compute
    hvd.init()
    model = _model()
    times = []
    _compute.watch(model, times.append)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        if rank == 1:
            time.sleep(SLOW_S)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    out.put((rank, times))
    hvd.shutdown()
    dist.destroy_process_group()


def test_the_horovod_layers_wait_in_step_is_not_compute_time():
    results = {r: rest[0] for r, rest in _two_ranks(_hvd_worker).items()}
    assert len(results[0]) == STEPS - 1 and len(results[1]) == STEPS - 1, results
    fast = statistics.median(results[0]) / 1e9
    slow = statistics.median(results[1]) / 1e9
    print("Horovod layer, median compute per step: rank 0 %.4f s, rank 1 (sleeps %.2f s) %.4f s"
          % (fast, SLOW_S, slow))
    assert slow >= SLOW_S * 0.9, slow
    assert fast < SLOW_S / 2, fast
