"""`horovod.torch.elastic` under `efdl run --horovod`: EFDL's (efdl/backend/horovod/torch/
elastic.py), the very module `hvd.elastic` is."""

import sys

from efdl.backend.horovod.torch import elastic as _elastic

sys.modules[__name__] = _elastic
