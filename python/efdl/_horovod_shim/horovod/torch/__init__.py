"""`horovod.torch` under `efdl run --horovod`: EFDL's Horovod-API layer (efdl/backend/horovod/
torch/_layer.py), the same objects as `import efdl.backend.horovod.torch as hvd` gives with
Horovod absent. A package (not an alias of the layer) so that `horovod.torch.elastic` imports."""

from efdl.backend.horovod.torch import _layer
from efdl.backend.horovod.torch._layer import *  # noqa: F401,F403 - Horovod's public API
from efdl.backend.horovod.torch._layer import __all__  # noqa: F401


def __getattr__(name):
    # elastic, HorovodInternalError, HostsUpdatedInterrupt and anything else of the layer.
    return getattr(_layer, name)
