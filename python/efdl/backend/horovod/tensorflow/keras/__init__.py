"""Horovod for Keras under EFDL: `from efdl.backend.horovod.tensorflow.keras import hvd`.

Needs real Horovod built with TensorFlow (see efdl.backend.horovod.tensorflow).
"""

from efdl.backend.horovod import import_native

hvd = import_native("horovod.tensorflow.keras",
                    "install TensorFlow, then Horovod built with it "
                    "(HOROVOD_WITH_TENSORFLOW=1 pip install horovod)")

__all__ = ["hvd"]
