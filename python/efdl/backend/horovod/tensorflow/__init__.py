"""Horovod for TensorFlow under EFDL: `from efdl.backend.horovod.tensorflow import hvd`.

Needs real Horovod built with TensorFlow (EFDL has no TensorFlow layer); the agent provides the
HOROVOD_* variables its Gloo controller reads. State for TensorFlow is not provided.
"""

from efdl.backend.horovod import import_native, native_env_problem

hvd = import_native("horovod.tensorflow",
                    "install TensorFlow, then Horovod built with it "
                    "(HOROVOD_WITH_TENSORFLOW=1 pip install horovod)")

if native_env_problem() is not None:
    raise ImportError("%s cannot join this job: %s" % (__name__, native_env_problem()))

__all__ = ["hvd"]
