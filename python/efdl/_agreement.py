"""Cross-rank agreement for State: which snapshot a round restores, and when it stops.

Both need torch.distributed's default group with world size > 1 (group_size() says); with
world 1, or before init(), State decides alone.

Restore. Each rank lists the snapshots it can restore (its node's arena, its storage directory),
the ranks gather those lists, and decide() picks the newest snapshot some rank holds. Ranks that
hold it restore it locally; each rank that lacks it (a newcomer with empty shared memory, a node
whose copy is older) receives it point-to-point from a rank that holds it: the manifest and the
packed tensor bytes, read through that rank's engine (so checksums are verified at the source).

Stop. The agent's stop request reaches each rank at its own moment; if ranks left at different
commits, the late one would block in a collective with peers that are gone. StopVote therefore
all-reduces (MAX) the local stop flag asynchronously at agreed commit() calls ("votes") and
reads the result at the next vote, so every rank sees the agreed stop at the same call. Votes
are spaced about _VOTE_SPACING_S apart: each vote also carries every rank's proposal for the
number of calls to the next one (that spacing divided by its measured time per call, at most
twice the current number), and the all-reduce's MAX of them is the same on every rank, so all
ranks vote at the same calls. With slow steps that is every call, as a vote per call once was;
with 1 ms steps, about one call in 50 — one extra collective per step cost more than the step
itself with 2 gloo ranks on 2 cores.
A stop takes effect within two spacings of the first rank seeing it.

Contract: every rank calls the same sequence of collectives here (State's constructor, commit()),
as DDP already requires of a training loop. Not thread-safe: use from the training thread.
"""

import atexit
import collections
import ctypes
import pickle
import time
import weakref

import torch
import torch.distributed as dist

from efdl import _dist, _unpickle

_ALIGN = 64

# key: (seq, step) of the chosen snapshot or None (nobody holds one); holders: ranks that restore
# it locally; receive_from: {rank lacking it: rank that sends it}.
Decision = collections.namedtuple("Decision", ["key", "holders", "receive_from"])


class NoCommonSnapshotError(RuntimeError):
    """Per-rank snapshots without a step that every rank holds (they cannot move between ranks)."""


def group_size():
    """World size of the default group when one exists and spans more than one rank, else 0."""
    if not _dist.is_initialized():
        return 0
    size = dist.get_world_size()
    return size if size > 1 else 0


def decide(offers, per_rank=False):
    """The restore decision from every rank's offer.

    offers[r]: the (seq, step) keys rank r can restore, newest first (may be empty). A seq names
    one commit on every node (the ranks align their engines' seq after each agreement); the step
    is compared too, so two unrelated snapshots that happen to share a seq are not confused.

    Data-parallel (per_rank False): the newest key any rank offers; ranks without it receive it,
    spread round-robin over the holders. per_rank: each rank's state is its own shard, so the
    newest key that every rank holds; NoCommonSnapshotError when ranks hold snapshots but none in
    common.
    """
    world = len(offers)
    offered = [set(o) for o in offers]
    if per_rank:
        common = set.intersection(*offered) if offered else set()
        if not common:
            if any(offered):
                have = ", ".join("rank %d: %s" % (r, "seq %d" % max(o)[0] if o else "none")
                                 for r, o in enumerate(offered))
                raise NoCommonSnapshotError(
                    "per-rank snapshots hold no step that every rank has (newest %s); sharded "
                    "states cannot be moved between ranks: restart at the world size that wrote "
                    "them, or start fresh with a new EFDL_JOB_ID" % have)
            return Decision(None, [], {})
        return Decision(max(common), list(range(world)), {})
    newest = [o[0] for o in offers if o]
    if not newest:
        return Decision(None, [], {})
    key = max(newest)
    holders = [r for r in range(world) if key in offered[r]]
    lacking = [r for r in range(world) if key not in offered[r]]
    return Decision(key, holders, {r: holders[i % len(holders)] for i, r in enumerate(lacking)})


def _device():
    """Where tensors given to collectives live: NCCL moves only CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather(obj, world):
    """Every rank's `obj` (small, picklable), in rank order."""
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def packed_layout(tensors):
    """Offsets of the (name, dtype, shape, nbytes) entries in one packed buffer, and its size."""
    offsets, total = [], 0
    for _, _, _, nbytes in tensors:
        offsets.append(total)
        total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, total


def _send_bytes(payload, dst):
    dev = _device()
    dist.send(torch.tensor([len(payload)], dtype=torch.int64, device=dev), dst)
    if payload:
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev), dst)


def _recv_bytes(src):
    dev = _device()
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(n, src)
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    if data.numel():
        dist.recv(data, src)
    return data.cpu().numpy().tobytes()


def send_snapshot(engine, ref, destinations, select=None):
    """Sends `ref` (a snapshot this rank's engine can read) to each rank in `destinations`.

    The bytes are read once into a packed buffer through engine.restore (checksums verified);
    a failure is sent instead of data, so the receivers raise rather than wait for a timeout.
    `engine` may also be a function reader(ref, ptrs); `select`: the names of the tensors to
    send (None: all), the receiver's snapshot holds only those (efdl/_shards.py).
    """
    entries = list(ref.tensors)
    chosen = entries if select is None else [e for e in entries if e[0] in select]
    header = {"seq": ref.seq, "step": ref.step, "tensors": chosen,
              "meta_json": ref.meta_json, "origin": "%s %s" % (ref.source, ref.path),
              "wall_time": getattr(ref, "wall_time", 0.0)}
    buf = None
    try:
        offsets, total = packed_layout(chosen)
        buf = torch.empty(total, dtype=torch.uint8)
        base = buf.data_ptr()
        at = {e[0]: base + off for e, off in zip(chosen, offsets)}
        read = engine if callable(engine) else engine.restore
        read(ref, [at.get(e[0], 0) for e in entries])
    except Exception as e:  # noqa: BLE001 - reported to the receivers, then re-raised here
        header = {"error": "rank %d could not read snapshot seq %d (%s): %s"
                           % (dist.get_rank(), ref.seq, ref.path, e)}
        for dst in destinations:
            _send_bytes(pickle.dumps(header, protocol=4), dst)
        raise
    blob = pickle.dumps(header, protocol=4)
    wire = buf.to(_device())  # the same tensor with gloo; one device copy with NCCL
    for dst in destinations:
        _send_bytes(blob, dst)
        dist.send(wire, dst)


class ReceivedSnapshot:
    """A snapshot received from another rank: looks like an engine's SnapshotRef to State
    (source, seq, step, path, tensors, meta_json) and restores from its packed buffer.
    Owns the buffer (released with the object)."""

    source = "peer"
    slot = -1

    def __init__(self, header, buf, src):
        self.seq = header["seq"]
        self.step = header["step"]
        self.wall_time = header.get("wall_time", 0.0)   # when it was committed (epoch seconds)
        self.tensors = [tuple(t) for t in header["tensors"]]
        self.meta_json = header["meta_json"]
        self.path = "rank %d (%s)" % (src, header["origin"])
        self._buf = buf
        self._offsets, _ = packed_layout(self.tensors)

    def restore(self, ptrs):
        """Copies tensor i into ptrs[i] (0: skip), like SnapshotEngine.restore."""
        if len(ptrs) != len(self.tensors):
            raise ValueError("restore got %d destinations for %d tensors"
                             % (len(ptrs), len(self.tensors)))
        base = self._buf.data_ptr()
        for ptr, off, entry in zip(ptrs, self._offsets, self.tensors):
            if ptr:
                ctypes.memmove(ptr, base + off, entry[3])


def receive_snapshot(src):
    """Receives the snapshot rank `src` sends with send_snapshot(); raises RuntimeError with the
    sender's reason when it could not read it."""
    header = _unpickle.loads(_recv_bytes(src), allow_globals=False)  # plain values only
    if "error" in header:
        raise RuntimeError(header["error"])
    _, total = packed_layout(header["tensors"])
    wire = torch.empty(total, dtype=torch.uint8, device=_device())
    dist.recv(wire, src)
    return ReceivedSnapshot(header, wire.cpu(), src)


# Time between two stop votes (module docstring), and the most calls between two: a loop whose
# steps suddenly get much slower waits at most twice that many calls for a stop.
_VOTE_SPACING_S = 0.05
_MAX_VOTE_CALLS = 200


class StopVote:
    """Agreement on graceful stops (see the module docstring). poll(local) returns True on every
    rank at the same call, at most two vote spacings after some rank passed local=True."""

    def __init__(self):
        # [stop flag, proposed calls to the vote after next], all-reduced with MAX
        self._flag = torch.zeros(2, dtype=torch.int32, device=_device())
        self._work = None
        self._calls = 0
        self._next_vote = 1          # call number of the next vote (the same on every rank)
        self._stop_seen = False      # a local stop seen between votes, carried to the next
        self._last_vote = None       # (time, call) of this rank's previous vote
        # The last poll leaves an all-reduce in flight; a process that exits with it pending
        # (its peer still finishing) aborts when the group is torn down: wait for it at exit.
        atexit.register(_finish_vote, weakref.ref(self))

    def __del__(self):
        # A State local to main() is collected before the interpreter exits, and the atexit hook
        # then finds nothing: complete the in-flight all-reduce here instead of leaving it to be
        # torn down with the process group.
        self.finish()

    def abandon(self):
        """Forgets the all-reduce in flight without waiting: its process group is being torn
        down (an in-process round change, efdl/_rounds.py)."""
        self._work = None

    def finish(self):
        """Waits for the all-reduce in flight, if any (errors ignored: the peers may be gone)."""
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - at exit, a failed peer is not this rank's error
                pass

    def poll(self, local_stop):
        self._calls += 1
        if local_stop:
            self._stop_seen = True
        if self._calls < self._next_vote:
            return False
        calls_to_next = 1
        if self._work is not None:
            self._work.wait()
            self._work = None
            stop, calls_to_next = self._flag.tolist()
            if stop > 0:
                return True
        # Every rank read the same all-reduce result at the same call: the same next vote.
        self._next_vote = self._calls + max(1, calls_to_next)
        now = time.monotonic()
        proposal = 1
        if self._last_vote is not None:
            per_call = (now - self._last_vote[0]) / max(1, self._calls - self._last_vote[1])
            # At most double the spacing per vote: calls that come in a burst (an epoch's end
            # commits twice in a row) must not stretch it to hundreds of slow steps at once.
            limit = min(_MAX_VOTE_CALLS, 2 * max(1, calls_to_next))
            proposal = int(min(limit, max(1.0, _VOTE_SPACING_S / max(per_call, 1e-9))))
        self._last_vote = (now, self._calls)
        self._flag.copy_(torch.tensor([1 if self._stop_seen else 0, proposal], dtype=torch.int32))
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return False


def _finish_vote(ref):
    vote = ref()
    if vote is not None:
        vote.finish()
