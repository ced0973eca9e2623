"""The meta text of State's snapshots: written with every commit, read back at restore.

The manifest of a snapshot (efdl._efdl) carries, beside the tensor layout, one JSON object:

    {"kwargs": {...}, "kwargs_exact": true, "pickle": "<base64>", "program": "train.py"}

"kwargs": every keyword argument JSON carries exactly (ints in int64's range, finite floats,
bools, None, strings), formatted here rather than pickled; the others are in the pickle, with a
readable JSON form in "kwargs" all the same. "pickle": {"kwargs": the keyword arguments only the
pickle carries, "optimizer": the parameter groups' hyper-parameters and the non-tensor optimizer
state, "scheduler": the scheduler's non-tensor state}, read back through the allow-list of
efdl/_unpickle.py. "program": the program that wrote it (absent when it has no file name).
Snapshots of older versions have no "kwargs_exact" and pickle every keyword argument.

The text has one writer, src/python/meta_text.h (efdl._efdl.meta_kwargs, meta_text,
program_field), for MetaWriter here and for the compiled commit path (src/python/fast_commit.h),
which repeats it while nothing it depends on changed: MetaWriter.cache is its pickle,
MetaWriter.program_field its tail. What is pickled, and how it is read back, is decided here.
"""

import base64
import json
import os
import pickle
import sys
import warnings

import torch

from efdl import _efdl, _env, _unpickle
from efdl._names import Env

SnapshotError = _efdl.SnapshotError

RESTORE_OTHER_PROGRAM_ENV = Env.RESTORE_OTHER_PROGRAM

# Hyper-parameters of these types let a commit reuse the previous pickle (MetaWriter.cache).
_IMMUTABLE = frozenset((int, float, bool, str, bytes, type(None), complex))


def program_name():
    """The running program's file name ("train.py"), or "" when there is none (python -c, an
    interactive session): recorded in each snapshot as its writer, so a different program that
    shares the job id is not silently restored into (docs/snapshots.md)."""
    arg = sys.argv[0] if sys.argv else ""
    return "" if arg in ("", "-c", "-m") else os.path.basename(arg)


def _display_json(value):
    """The manifest's readable JSON of a keyword argument that is pickled for the restore."""
    try:
        text = json.dumps(value, allow_nan=False)
        if "\\ud" not in text:  # no surrogate escape at all (json.dumps writes lower case)
            return text
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
        return text
    except (TypeError, ValueError):  # UnicodeEncodeError is a ValueError
        return json.dumps(repr(value))


def _immutable(v):
    t = type(v)
    return t in _IMMUTABLE or (t is tuple and all(_immutable(x) for x in v))


class MetaWriter:
    """Formats the meta text of each commit of one State (`program`: program_name()).

    cache: (fingerprint, base64 pickle) of the last commit whose pickle may be reused: no
    keyword argument only the pickle carries, no scheduler, no non-tensor optimizer state, every
    hyper-parameter immutable. fingerprint: (id(optimizer), [(len(params), *values) per group]),
    None without an optimizer. The compiled commit path compares the groups against it."""

    __slots__ = ("program_field", "cache")

    def __init__(self, program):
        # appended to the meta object's members: the program that wrote the snapshot
        self.program_field = _efdl.program_field(program)
        self.cache = None

    def text(self, values, optimizer, scalars, sched_sd, shard=None):
        """The meta text of a commit: `values` the keyword arguments, `optimizer` the optimizer
        or None, `scalars` its non-tensor state by parameter index, `sched_sd` the scheduler's
        state_dict() or None, `shard` the layout of a sharded optimizer's part this rank holds
        (efdl/_shards.py: pickled as meta["optimizer"]["shard"]; never cached) or None.

        The plain keyword arguments (ints in int64's range, finite floats, bools, None, strings:
        epoch, step) are written as JSON, exactly, by meta_text.h rather than pickled (tensors
        are left out), and the pickle is reused while the optimizer's hyper-parameters are
        unchanged - this runs on every commit (docs/snapshots.md, "Measured")."""
        kwargs_json, rest = _efdl.meta_kwargs(values, torch.Tensor, _display_json)
        fingerprint = None
        if rest is None and sched_sd is None and not scalars and shard is None:
            fingerprint = (id(optimizer), None if optimizer is None else [
                (len(g["params"]),) + tuple(g.values()) for g in optimizer.param_groups])
            cached = self.cache
            try:
                if cached is not None and cached[0] == fingerprint:
                    return _efdl.meta_text(kwargs_json, cached[1], self.program_field)
            except Exception:  # noqa: BLE001 - a hyper-parameter without a plain ==: re-pickle
                pass
        meta = {"kwargs": rest or {}}
        if optimizer is not None:
            groups = []
            for g in optimizer.param_groups:
                g = dict(g)
                g["num_params"] = len(g.pop("params"))
                groups.append(g)
            meta["optimizer"] = {"param_groups": groups, "state": scalars}
            if shard is not None:
                meta["optimizer"]["shard"] = shard
        if sched_sd is not None:
            meta["scheduler"] = {k: v for k, v in sched_sd.items()
                                 if not isinstance(v, torch.Tensor)}
        raw = pickle.dumps(meta, protocol=4)
        try:  # what a restore would refuse fails now, not after a crash (efdl/_unpickle.py)
            _unpickle.check(raw)
        except _unpickle.RefusedType as e:
            raise TypeError("State.commit: the snapshot's metadata (keyword arguments, optimizer "
                            "hyper-parameters, scheduler state) cannot be restored: %s" % e
                            ) from None
        blob = base64.b64encode(raw).decode()
        # Reused only while every hyper-parameter is immutable: one changed in place would
        # still compare equal to the fingerprint's reference to it.
        groups = meta["optimizer"]["param_groups"] if "optimizer" in meta else ()
        if not all(_immutable(v) for g in groups for v in g.values()):
            fingerprint = None
        self.cache = None if fingerprint is None else (fingerprint, blob)
        return _efdl.meta_text(kwargs_json, blob, self.program_field)


def read(ref, program, job):
    """The unpickled metadata of snapshot `ref` ({"kwargs": every keyword argument, "optimizer",
    "scheduler" as written}), or None with a warning when it is unreadable (damage: the caller
    tries an older snapshot). `program`: this program's name, `job`: the job id.

    Raises SnapshotError when another program wrote it (unless EFDL_RESTORE_OTHER_PROGRAM=1) or
    when its pickle holds a type the allow-list refuses: every snapshot of that program holds
    it, so falling back to older ones would lose trained steps silently."""
    try:
        meta_doc = json.loads(ref.meta_json)
        writer = meta_doc.get("program", "") if isinstance(meta_doc, dict) else ""
    except Exception as e:  # noqa: BLE001 - any damage means: try the previous one
        warnings.warn("efdl: skipping snapshot seq %d in %s: unreadable metadata (%s)"
                      % (ref.seq, ref.path, e))
        return None
    if (writer and program and writer != program
            and not _env.env_flag(RESTORE_OTHER_PROGRAM_ENV, False, words=("1",),
                                  normalize=False)):
        raise SnapshotError(
            "job %r: snapshot seq %d (step %d) in %s was written by the program %r, not by "
            "this one (%r): two programs share the job id. Give this one its own (--job, or "
            "EFDL_JOB_ID), start the job over with `efdl reset --job %s`, or set %s=1 to "
            "restore it anyway" % (job, ref.seq, ref.step, ref.path, writer, program, job,
                                   RESTORE_OTHER_PROGRAM_ENV))
    try:
        meta = _unpickle.loads(base64.b64decode(meta_doc["pickle"]))
        if meta_doc.get("kwargs_exact"):  # see MetaWriter; older snapshots pickled every kwarg
            kwargs = dict(meta_doc["kwargs"])
            kwargs.update(meta.get("kwargs") or {})
            meta["kwargs"] = kwargs
    except _unpickle.RefusedType as e:
        # Not damage: every snapshot of this program holds it. Stop rather than fall back
        # to older ones or start over (a restore must never lose trained steps silently).
        raise SnapshotError("job %r: snapshot seq %d in %s: %s"
                            % (job, ref.seq, ref.path, e)) from None
    except Exception as e:  # noqa: BLE001 - any damage means: try the previous one
        warnings.warn("efdl: skipping snapshot seq %d in %s: unreadable metadata (%s)"
                      % (ref.seq, ref.path, e))
        return None
    return meta
