"""The fault suite's training program: digits, a small CNN, DDP over gloo, efdl.State.

It commits after every step and prints what the checker needs, each line with the wall-clock
time (time.time(); every process of a test runs on this machine, so the times are comparable):

    RESUME round=R rank=r world=W step=S pid=P src=K seq=Q crc=C t=T
                                               the step State restored (0: fresh start), this
                                               process's pid, where the snapshot came from
                                               (K: 0 none, 1 memory, 2 storage, 3 peer), its seq
    STEP   round=R rank=r world=W step=S t=T   step S finished (its all-reduce completed)
    COMMIT round=R rank=r step=S crc=C t=T     commit() of step S is about to be called
    ACK    round=R rank=r step=S lr=L t=T      commit() of step S returned; L is the local
                                               rank: only local rank 0 writes the node's
                                               snapshot, so only its ACK acknowledges a commit
    DONE   round=R rank=r world=W step=S t=T   the job's last step is done on every rank

`step` counts optimizer steps of the whole job (it continues across rounds). `crc` is a CRC32
of everything the State commits: the model's state_dict, the optimizer's state_dict (momentum
buffers and hyper-parameters), the scheduler's state_dict, the plain keyword arguments (`step`,
`seen`, and `recent`, a list State pickles) and every byte of the tensor keyword argument
`ballast` (filled with the step before each commit), so a restored state can be compared with
what was committed: a snapshot torn by a kill inside the copy, or a part restored from another
commit, would not match any COMMIT of its step. Options come from the
environment so every node runs the same command line:

  FAULT_STEPS        steps of the whole job (default 60)
  FAULT_STEP_TIME    seconds to sleep after each commit (default 0.05)
  FAULT_BALLAST_MB   an extra tensor of this many MiB in the State, so commit() and the
                     persister take long enough for a kill to land inside them (default 0)
  FAULT_HANG         "RANK:STEP": that rank stops calling collectives at that step (it sleeps),
                     so its peers hang inside the all-reduce; once per job (FAULT_MARK_DIR)
  FAULT_MARK_DIR     a directory where one-shot faults leave a marker so they happen once
  FAULT_PG_TIMEOUT   the process group's timeout in seconds (default 30)
  FAULT_FAIL         "RANK:STEP": that rank exits 3 at that step (every time it gets there)
  FAULT_PAUSE        "STEP:SECONDS": every rank announces a pause (efdl.pause_expected) at that
                     step and sleeps that long, as an evaluation would (hang detection must not
                     fire); once per job
  FAULT_FIRST_STEP   seconds the first step of each process takes on top (a compile, a cache
                     warm-up), not announced to efdl
  FAULT_IGNORE_TERM  a rank, or "all": that rank ignores SIGTERM (installed before State, which
                     then keeps its hands off SIGTERM)
  FAULT_ANNOUNCE     1: also announce each commit in FAULT_MARK_DIR by creating
                     commit-<pid>-<step> right before commit() and ack-<pid>-<step> once it
                     returned; unlike the stdout lines (relayed by the agent) these survive a
                     SIGKILL of the whole node, so the harness can tell at a kill whether
                     commit() had begun and not returned
  FAULT_HELPER       1: start a helper process (a sleeping python child, as a program starts a
                     data-preparation or upload process) that nothing ends but its process group
                     being killed
"""

import os
import signal
import sys
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.join(REPO, "tests", "python", "workers"))
import efdl.backend.torch as efdl  # noqa: E402
import fault_marks  # noqa: E402
from digits import DigitsCNN, load_digits_datasets  # noqa: E402

BATCH = 16


def rank_step(spec):
    if not spec:
        return None
    rank, step = spec.split(":")
    return int(rank), int(step)


def once(name):
    """True the first time a one-shot fault `name` fires in this job (marker file)."""
    return fault_marks.once(os.environ.get("FAULT_MARK_DIR"), name)


def say(kind, **fields):
    text = " ".join("%s=%s" % kv for kv in fields.items())
    print("%s %s t=%.6f" % (kind, text, time.time()), flush=True)


SOURCES = {None: 0, "memory": 1, "storage": 2, "peer": 3}


def _crc_of(value, crc):
    """CRC32 of a state_dict-like value: tensors by their bytes, the rest by repr (dicts in key
    order: a state_dict's order is its own)."""
    if isinstance(value, torch.Tensor):
        return zlib.crc32(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    if isinstance(value, dict):
        for k, v in value.items():
            crc = _crc_of(v, zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(value, (list, tuple)):
        for v in value:
            crc = _crc_of(v, crc)
        return crc
    return zlib.crc32(repr(value).encode(), crc)


def digest(state, model, optimizer, scheduler, ballast):
    """The CRC of everything `state` commits (see the module docstring)."""
    crc = _crc_of(model.state_dict(), 0)
    crc = _crc_of(optimizer.state_dict(), crc)
    crc = _crc_of(scheduler.state_dict(), crc)
    crc = _crc_of([state.step, state.seen, state.recent], crc)
    return _crc_of(ballast, crc)


def announce(kind, step):
    if os.environ.get("FAULT_ANNOUNCE") == "1" and os.environ.get("FAULT_MARK_DIR"):
        path = os.path.join(os.environ["FAULT_MARK_DIR"], "%s-%d-%d" % (kind, os.getpid(), step))
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def main():
    steps = int(os.environ.get("FAULT_STEPS", "60"))
    step_time = float(os.environ.get("FAULT_STEP_TIME", "0.05"))
    ballast_mb = int(os.environ.get("FAULT_BALLAST_MB", "0"))
    hang = rank_step(os.environ.get("FAULT_HANG"))
    fail = rank_step(os.environ.get("FAULT_FAIL"))
    pause = os.environ.get("FAULT_PAUSE")
    first_step_s = float(os.environ.get("FAULT_FIRST_STEP", "0"))
    pause_step, pause_s = (int(pause.split(":")[0]), float(pause.split(":")[1])) if pause else (
        None, 0.0)
    ignore_term = os.environ.get("FAULT_IGNORE_TERM")
    if ignore_term in ("all", os.environ.get("RANK")):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    if os.environ.get("FAULT_HELPER") == "1":
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    efdl.init(timeout=float(os.environ.get("FAULT_PG_TIMEOUT", "30")))
    rank, world = dist.get_rank(), dist.get_world_size()
    round_ = int(os.environ.get("EFDL_ROUND", "0"))

    torch.manual_seed(0)
    train, _ = load_digits_datasets()
    model = DigitsCNN(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    ballast = torch.zeros(ballast_mb * (1 << 18))  # float32: 4 bytes each
    state = efdl.State(model, optimizer, scheduler, step=0, seen=0, recent=[], ballast=ballast)
    state.set_commit_interval(1)
    ballast = state.ballast   # a restored tensor keyword may be a new tensor, not the one given
    source, seq, _ = state.restored_from or (None, 0, 0)
    say("RESUME", round=round_, rank=rank, world=world, step=state.step, pid=os.getpid(),
        src=SOURCES.get(source, 9), seq=seq,
        crc=digest(state, model, optimizer, scheduler, ballast))
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    batches = len(train) // BATCH
    while state.step < steps:
        if hang is not None and (rank, state.step) == hang and once("hang"):
            say("HANGING", round=round_, rank=rank, step=state.step)
            while True:
                time.sleep(3600)
        if state.step == pause_step and once("pause-%d" % rank):
            say("PAUSING", round=round_, rank=rank, step=state.step, seconds=int(pause_s))
            with efdl.pause_expected(pause_s * 1.5):
                time.sleep(pause_s)
        if fail is not None and (rank, state.step) == fail:
            say("FAILING", round=round_, rank=rank, step=state.step)
            sys.exit(3)
        if first_step_s > 0:
            say("SLOWFIRST", round=round_, rank=rank, step=state.step, seconds=int(first_step_s))
            time.sleep(first_step_s)
            first_step_s = 0
        # Deterministic data per (step, rank): a resumed step trains the same batch again.
        first = ((state.step * world + rank) % batches) * BATCH
        x, y = train[first:first + BATCH]
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        state.step += 1
        state.seen += len(x)
        state.recent = (state.recent + [round(float(loss), 6)])[-3:]
        say("STEP", round=round_, rank=rank, world=world, step=state.step)
        ballast.fill_(state.step)
        say("COMMIT", round=round_, rank=rank, step=state.step,
            crc=digest(state, model, optimizer, scheduler, ballast))
        announce("commit", state.step)
        state.commit()
        announce("ack", state.step)
        say("ACK", round=round_, rank=rank, step=state.step,
            lr=int(os.environ.get("LOCAL_RANK", "0")))
        time.sleep(step_time)
    dist.barrier()
    say("DONE", round=round_, rank=rank, world=world, step=state.step)


if __name__ == "__main__":
    main()
