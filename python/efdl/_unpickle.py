"""Unpickling of snapshot metadata with an allow-list (issue #17).

A snapshot's metadata (the keyword arguments JSON cannot carry, optimizer hyper-parameters,
scheduler state) is a pickle, read back from shared memory or storage. Whoever can write there
could otherwise run code in every worker that restores, so only these globals are unpickled, the
way torch.load(weights_only=True) restricts a checkpoint:

- builtin values and containers (complex, set, frozenset, bytearray, slice, range and the plain
  types), collections (OrderedDict, deque, Counter, defaultdict), datetime, Decimal, Fraction;
- torch: dtypes, torch.device, torch.Size and tensors (their storages are read back with
  torch.load(weights_only=True));
- numpy: arrays, dtypes and scalars.

Anything else is refused with a line naming it. A program that really stores its own classes
names them in EFDL_UNPICKLE_ALLOW (comma-separated `module.QualName`, or `module.*` for every
name in a module); docs/snapshots.md, "What State unpickles". State also checks each metadata
pickle when it writes it (check(): the allowed classes of the program are not run), so a value
a restore would refuse fails the commit that stores it, not the restore after a crash.
"""

import io
import os
import pickle

from efdl._names import Env

ALLOW_ENV = Env.UNPICKLE_ALLOW

_SAFE = {
    "builtins": frozenset(("complex", "set", "frozenset", "bytearray", "slice", "range", "list",
                           "dict", "tuple", "int", "float", "str", "bytes", "bool")),
    "collections": frozenset(("OrderedDict", "deque", "Counter", "defaultdict")),
    "datetime": frozenset(("datetime", "date", "time", "timedelta", "timezone")),
    "decimal": frozenset(("Decimal",)),
    "fractions": frozenset(("Fraction",)),
    "torch": frozenset(("device", "Size")),
    "torch._utils": frozenset(("_rebuild_tensor_v2", "_rebuild_parameter")),
    "numpy": frozenset(("dtype", "ndarray")),
    "numpy.core.multiarray": frozenset(("scalar", "_reconstruct")),
    "numpy._core.multiarray": frozenset(("scalar", "_reconstruct")),
}


class RefusedType(pickle.UnpicklingError):
    """A pickle names a global that is not on the allow-list."""

    def __init__(self, module, name):
        self.qualname = "%s.%s" % (module, name)
        super().__init__(
            "it holds a %s, which efdl does not unpickle from a snapshot unless allowed: if your "
            "program stores it on purpose, start it with %s=%s (docs/snapshots.md, \"What State "
            "unpickles\")" % (self.qualname, ALLOW_ENV, self.qualname))


def _user_allowed(module, name, spec):
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item == "%s.%s" % (module, name) or (item.endswith(".*") and item[:-2] == module):
            return True
    return False


def _storage_from_bytes(data):
    # What torch.storage._load_from_bytes does, without its unrestricted torch.load.
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


class _Placeholder:
    """Stands in for a class or function the user allowed while a pickle is only checked: the
    check must not run the program's own code (constructors, __setstate__, side effects)."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, allow_globals, user_spec, check_only):
        super().__init__(file)
        self._allow_globals = allow_globals
        self._user_spec = user_spec
        self._check_only = check_only

    def find_class(self, module, name):
        if self._allow_globals:
            if name in _SAFE.get(module, ()):
                return super().find_class(module, name)
            if module == "torch.storage" and name == "_load_from_bytes":
                return _storage_from_bytes
            if module == "torch":
                import torch
                value = getattr(torch, name, None)
                if isinstance(value, torch.dtype):
                    return value
            if self._user_spec and _user_allowed(module, name, self._user_spec):
                return _Placeholder if self._check_only else super().find_class(module, name)
        raise RefusedType(module, name)


def loads(data, allow_globals=True):
    """pickle.loads with the allow-list above (plus EFDL_UNPICKLE_ALLOW); with
    allow_globals=False, only plain values and containers. Raises RefusedType for a global that
    is not allowed, pickle.UnpicklingError (or another error) for damaged data."""
    user_spec = os.environ.get(ALLOW_ENV, "") if allow_globals else ""
    return _Unpickler(io.BytesIO(data), allow_globals, user_spec, False).load()


def check(data):
    """Raises RefusedType when loads(data) would; runs none of the globals the user allowed."""
    _Unpickler(io.BytesIO(data), True, os.environ.get(ALLOW_ENV, ""), True).load()

