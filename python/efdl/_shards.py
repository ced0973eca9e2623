"""Sharded optimizer state under State (issue #35, part 1): torch's ZeroRedundancyOptimizer.

A ZeroRedundancyOptimizer (ZeRO) keeps the whole parameter list in its param_groups (the
"global" parameter indices State names its optimizer tensors by) and the state of its own part
in the optimizer it wraps (`zero.optim`): rank r of a world of W owns the parameters ZeRO's
partition gives it, and holds their Adam moments and step counts only. State holds such an
optimizer with per-rank snapshots (EFDL_SNAPSHOT_PER_RANK=1, scope "rank<N>"): each rank commits
the model (replicated), the keyword values, and ITS shard - "optimizer/<global index>/<key>" for
the parameters it owns - with its layout in the meta text: meta["optimizer"]["shard"] =
{"rank": r, "world": W, "owned": [global indices]}.

After a world-size change the new ranks rebuild their shards of the new layout from the shards
of the old one, never by gathering the optimizer on one rank:

1. agreement (State._agreed_snapshot, collective): each new rank offers the sharded snapshots it
   can read itself - the arenas of every old rank that lived on its node (shared memory), the
   copies its agent keeps of its ring predecessor's per-rank arenas (memory (peer copy), issue
   #35 part 2: src/agent/peer_copy.h) and the per-rank stores it can see (storage) - as
   (seq, step, old rank, old world, source, owned).
   decide() picks the newest (seq, step) whose old shards are all offered by some rank. Each new
   rank then restores the model and keyword values from one old shard (base_of), sent by its
   holder without its optimizer tensors when the rank does not read it itself.
2. optimizer (State, when the ZeroRedundancyOptimizer of the new round is given, collective):
   the ranks exchange the global indices their new ZeRO owns; plan() gives, for every new rank,
   which old shard holds each of its parameters and which rank reads it: this node's memory
   (the rank itself), else another rank's memory (the least loaded holder sends), else storage
   (the rank itself when it sees the store, else a rank that does); the pieces move point-to-point
   (torch.distributed send/recv over the round's group, in one global order every rank follows,
   so blocking sends cannot deadlock), each carrying only the receiver's parameters.

If an old shard is in no rank's memory and in no store any rank can read (State looks again
for a few seconds first: a leaving node's final shard may be on its way to storage), the newest
complete snapshot is used instead (rank 0 names what is missing); when there is none,
ShardsMissingError says which old ranks' shards are missing and State adds what to do.

Here: the pure logic (decide, base_of, plan, transfers: no processes), what State reads of a
ZeRO, which old ranks' snapshots a rank may read itself, the restore log's words, and the
composed snapshot a rank restores its shard from. The agreement and the transfers run in State
(_sharded_offers, _agreed_sharded, _restore_zero), over efdl/_agreement.py's send/receive.
"""

import collections
import glob
import os
import re


from efdl import _efdl

ZERO = "ZeroRedundancyOptimizer"

# One sharded snapshot a rank can read itself: old_rank's shard of commit (seq, step), written
# in a world of old_world ranks; source "memory" (this node's shared memory), "peer_copy" (the
# copy this node's agent keeps of its ring predecessor's arena) or "storage";
# owned: the global parameter indices that old rank owned.
Offer = collections.namedtuple("Offer", "seq step old_rank old_world source owned")

MEMORY, PEER_COPY, STORAGE = "memory", "peer_copy", "storage"
# The order a shard is read in: the memory it was written to, then a peer's copy of it (memory
# too, as old as the last asynchronous transfer), then storage.
_PREFERENCE = {MEMORY: 0, PEER_COPY: 1, STORAGE: 2}


def preference(source):
    return _PREFERENCE.get(source, len(_PREFERENCE))

# The agreed sharded snapshot: key (seq, step); old_world; owned {old rank: [indices]};
# holders {old rank: [(new rank, source)]}, memory first; skipped: (key, [missing old ranks])
# of a newer snapshot that was incomplete, or None.
Decision = collections.namedtuple("Decision", "key old_world owned holders skipped")

# One piece of a new rank's shard: the parameters `indices` of old rank `old_rank`'s shard,
# read by rank `src` (the receiver itself when src == the new rank) from `source`.
Fetch = collections.namedtuple("Fetch", "old_rank src source indices")


class ShardsMissingError(RuntimeError):
    """Some old shard of every sharded snapshot is available nowhere."""


# -- what State reads of a ZeroRedundancyOptimizer -----------------------------------------------

def is_zero(optimizer):
    return optimizer is not None and any(c.__name__ == ZERO for c in type(optimizer).__mro__)


def unsupported_zero(zero):
    """Why State cannot hold this ZeroRedundancyOptimizer, or None."""
    if getattr(zero, "_overlap_with_ddp", False):
        return "it was built with overlap_with_ddp=True (its state lives in DDP's buckets)"
    if not hasattr(zero, "optim"):
        return "it has no local optimizer (`optim`)"
    return None


def local_state(optimizer):
    """The optimizer state State snapshots: a ZeRO's local shard (`optim.state`), else `state`."""
    return optimizer.optim.state if is_zero(optimizer) else optimizer.state


def owned(zero):
    """The global parameter indices (order of zero.param_groups) this rank's ZeRO owns."""
    index = {id(p): i for i, p in enumerate(p for g in zero.param_groups for p in g["params"])}
    return sorted(index[id(p)] for g in zero.optim.param_groups for p in g["params"])


def layout(zero):
    """The shard layout committed with each snapshot (meta["optimizer"]["shard"])."""
    return {"rank": int(zero.rank), "world": int(zero.world_size), "owned": owned(zero)}


def stale(zero):
    """Whether `zero` belongs to a process group that no longer is the default one (an
    in-process round change destroyed it): the program builds a new one for the new round."""
    import torch.distributed as dist
    try:
        return zero.process_group is not dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - no default group at all
        return True


# -- pure logic ----------------------------------------------------------------------------------

def decide(offers_by_rank):
    """The sharded snapshot the new ranks restore, from every new rank's offers (lists of Offer);
    None when nobody offers one. Raises ShardsMissingError when offers exist but no snapshot
    has all of its old shards offered."""
    keys = {}
    for new_rank, offers in enumerate(offers_by_rank):
        for o in offers:
            key = (o.seq, o.step)
            entry = keys.setdefault(key, {"world": o.old_world, "owned": {}, "holders": {}})
            if entry["world"] != o.old_world or not 0 <= o.old_rank < o.old_world:
                continue   # not one commit of one world: never mixed
            entry["owned"][o.old_rank] = list(o.owned)
            held = entry["holders"].setdefault(o.old_rank, [])
            if (new_rank, o.source) not in held:
                held.append((new_rank, o.source))
    if not keys:
        return None

    def missing(key):
        e = keys[key]
        return [r for r in range(e["world"]) if r not in e["holders"]]

    complete = [k for k in keys if not missing(k)]
    newest = max(keys)
    if not complete:
        raise ShardsMissingError(
            "the newest sharded snapshot (seq %d, step %d, written by %d ranks) lacks the "
            "optimizer shard of old rank(s) %s: in no surviving rank's memory and in no "
            "snapshot store a rank can read, and no older snapshot is complete"
            % (newest[0], newest[1], keys[newest]["world"],
               ", ".join(str(r) for r in missing(newest))))
    best = max(complete)
    e = keys[best]
    holders = {}
    for r, held in e["holders"].items():
        # memory, then a peer copy, then storage; one entry per new rank (its best source)
        seen, ordered = set(), []
        for n, source in sorted(held, key=lambda h: (preference(h[1]), h[0])):
            if n not in seen:
                seen.add(n)
                ordered.append((n, source))
        holders[r] = ordered
    skipped = None if newest == best else (newest, missing(newest))
    return Decision(best, e["world"], e["owned"], holders, skipped)


def _choose(held, n, load):
    """Who reads one old shard for new rank `n`, from its holders `held` [(rank, source)]: this
    node's memory (n itself), else another rank's memory over the network, else a peer copy
    (this node's, else another rank's), else storage (n itself, else another rank), the least
    loaded sender first."""
    pools = collections.defaultdict(list)
    for h in held:
        pools[preference(h[1])].append(h)
    for _, pool in sorted(pools.items()):
        mine = [h for h in pool if h[0] == n]
        if mine:
            return mine[0]
        if pool:
            return min(pool, key=lambda h: (load[h[0]], h[0]))
    raise ShardsMissingError("no holder")   # decide() never leaves an old shard without one


def base_of(decision, new_world):
    """{new rank: (old rank, src rank, source)}: the old shard each new rank restores the model
    and keyword values from (they are replicated: any shard has them): one in this node's
    memory (its own old rank first), else one in another rank's memory, else a peer copy, else
    storage."""
    load = collections.Counter()
    out = {}
    for n in range(new_world):
        best = None
        for r in sorted(decision.holders, key=lambda r: (r != n, (r - n) % decision.old_world)):
            src, source = _choose(decision.holders[r], n, load)
            rank_of = (preference(source), src != n, load[src])
            if best is None or rank_of < best[0]:
                best = (rank_of, (r, src, source))
        r, src, source = best[1]
        if src != n:
            load[src] += 1
        out[n] = (r, src, source)
    return out


def plan(decision, new_owned):
    """{new rank: [Fetch]}: where each new rank's parameters (new_owned[n], global indices) come
    from. Every index is in exactly one old shard (ShardsMissingError otherwise: the model
    changed); each old shard is read from this node's memory, else another rank's memory (it
    sends the receiver's parameters only), else storage (_choose)."""
    where = {}
    for r, indices in decision.owned.items():
        for i in indices:
            where[i] = r
    load = collections.Counter()
    out = {}
    for n, indices in enumerate(new_owned):
        by_old = collections.defaultdict(list)
        for i in indices:
            if i not in where:
                raise ShardsMissingError(
                    "parameter %d of the optimizer is in no old shard of snapshot seq %d (the "
                    "old ranks owned %d parameters): the model changed since it was written"
                    % (i, decision.key[0], len(where)))
            by_old[where[i]].append(i)
        fetches = []
        for r in sorted(by_old):
            src, source = _choose(decision.holders[r], n, load)
            if src != n:
                load[src] += len(by_old[r])
            fetches.append(Fetch(r, src, source, sorted(by_old[r])))
        out[n] = fetches
    return out


def transfers(fetch_plan):
    """The network transfers of a plan in the one order every rank follows: [(dst, Fetch)]."""
    return [(n, f) for n in sorted(fetch_plan) for f in fetch_plan[n] if f.src != n]


def optimizer_names(entries, indices):
    """The names of `entries` (name, dtype, shape, nbytes) that are optimizer state of the given
    global parameter indices."""
    wanted = {str(i) for i in indices}
    return {e[0] for e in entries
            if e[0].startswith("optimizer/") and e[0].split("/", 2)[1] in wanted}


def not_optimizer(entries):
    return {e[0] for e in entries if not e[0].startswith("optimizer/")}


# -- what a rank can read itself -----------------------------------------------------------------

def scope_rank(scope):
    m = re.fullmatch(r"rank(\d+)", scope)
    return int(m.group(1)) if m else None


def readable_peer_copies(shm_dir, job, holder):
    """The old ranks whose per-rank arenas this node's agent keeps a peer copy of (arena scope
    "peer.rank<N>" under its holder: src/snapshot/arena_dir.h)."""
    ranks = set()
    probe = _efdl.arena_path(shm_dir, job, holder, _efdl.peer_arena_scope("rank0"))
    head = probe[:-len("rank0.arena")]
    for path in glob.glob(glob.escape(head) + "rank*.arena"):
        r = scope_rank(path[len(head):-len(".arena")])
        if r is not None:
            ranks.add(r)
    return sorted(ranks)


def readable_scopes(shm_dir, job, holder, snapshot_dir):
    """The old ranks whose per-rank snapshots this rank may read itself: arenas of this job and
    holder in this node's shared memory, and per-rank stores under the job's store directory."""
    ranks = set()
    probe = _efdl.arena_path(shm_dir, job, holder, "rank0")
    head = probe[:-len("rank0.arena")]
    for path in glob.glob(glob.escape(head) + "rank*.arena"):
        r = scope_rank(path[len(head):-len(".arena")])
        if r is not None:
            ranks.add(r)
    job_dir = _efdl.store_dir(snapshot_dir, job, False, 0)
    try:
        names = os.listdir(job_dir)
    except OSError:
        names = []
    for name in names:
        m = re.fullmatch(r"rank-(\d+)", name)
        if m:
            ranks.add(int(m.group(1)))
    return sorted(ranks)


class ComposedSnapshot:
    """A rank's snapshot put together from pieces of several old shards: looks like a
    SnapshotRef to State (source, seq, step, path, tensors, meta_json) and restores each tensor
    from the piece that holds it. pieces: [(reader, ref, names)]: `reader(ref, ptrs)` copies
    ref's tensor i to ptrs[i]; `names` the tensors of ref this snapshot takes."""

    source = "resharded"
    slot = -1

    def __init__(self, seq, step, pieces, meta_json, path, wall_time=0.0):
        self.seq, self.step, self.wall_time = seq, step, wall_time
        self.meta_json = meta_json
        self.path = path
        self._pieces = pieces
        self.tensors = [e for _, ref, names in pieces for e in ref.tensors if e[0] in names]

    def restore(self, ptrs):
        if len(ptrs) != len(self.tensors):
            raise ValueError("restore got %d destinations for %d tensors"
                             % (len(ptrs), len(self.tensors)))
        by_name = {e[0]: p for e, p in zip(self.tensors, ptrs)}
        for reader, ref, names in self._pieces:
            sub = [by_name.get(e[0], 0) if e[0] in names else 0 for e in ref.tensors]
            if any(sub):
                reader(ref, sub)


def describe(fetch, me, path):
    """How the restore log names where an old shard came from."""
    if fetch.src == me:
        where = {MEMORY: "this node's memory", PEER_COPY: "this node's peer copy"}.get(
            fetch.source, "storage (%s)" % path)
    else:
        where = "rank %d over the network (from its %s)" % (
            fetch.src, {MEMORY: "node's memory", PEER_COPY: "node's peer copy"}.get(
                fetch.source, "storage"))
    return "old shard %d from %s" % (fetch.old_rank, where)


def merge_optimizer_meta(metas, indices):
    """The optimizer meta of a composed snapshot: the first piece's hyper-parameters, and the
    non-tensor state of the given indices from every piece."""
    merged = dict(metas[0])
    opt = dict(merged["optimizer"])
    wanted = set(indices)
    state = {}
    for m in metas:
        for i, small in (m.get("optimizer", {}).get("state") or {}).items():
            if int(i) in wanted:
                state[int(i)] = small
    opt["state"] = state
    opt.pop("shard", None)
    merged["optimizer"] = opt
    return merged


