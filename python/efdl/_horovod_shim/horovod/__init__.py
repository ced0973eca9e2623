"""EFDL's stand-in for the `horovod` package, for `efdl run --horovod` (docs/horovod.md, "Horovod
programs unchanged").

Only that option puts this directory (efdl/_horovod_shim) in front of the workers' PYTHONPATH,
so an unmodified `import horovod.torch as hvd` gets EFDL's Horovod-API layer over
torch.distributed. It stands in for Horovod only where Horovod is not installed: when another
`horovod` is importable on the rest of sys.path, importing this one fails with one line (the
agent refuses `--horovod` up front in that case too).
"""

import importlib.machinery as _machinery
import os as _os
import sys as _sys

_SHIM_DIR = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


def _real_horovod():
    """Where another `horovod` would be imported from, or None."""
    rest = [p for p in _sys.path
            if _os.path.abspath(p or _os.getcwd()) != _SHIM_DIR]
    spec = _machinery.PathFinder.find_spec("horovod", rest)
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "?"


_other = _real_horovod()
if _other is not None:
    raise ImportError("efdl run --horovod: a real Horovod is installed (%s); run without "
                      "--horovod (EFDL serves real Horovod's rendezvous) or uninstall it"
                      % _other)
del _other

# What programs read of the package itself.
__version__ = "0+efdl"
