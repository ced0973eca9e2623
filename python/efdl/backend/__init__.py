"""Framework backends: `efdl.backend.torch` (torch DDP) and `efdl.backend.horovod.*`."""
