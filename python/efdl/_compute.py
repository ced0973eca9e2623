"""Each rank's compute time per step, for straggler detection (issue #32 part 3;
src/health/straggler_rules.h owns the rule, docs/operations.md "Stragglers" says what is measured).

Under synchronous data parallelism every rank's step takes the same time: a slow rank makes the
others wait in the gradient all-reduce. What differs is where the time goes, so each rank
measures its COMPUTE TIME: from the end of its previous backward pass (after DDP waited for the
previous step's gradient all-reduce) to the moment its own gradients of this step were ready
(the last parameter's gradient hook). That covers data loading, the forward and backward
passes, the optimizer step and the commit; it excludes the wait for peers.

How: a tensor hook on every parameter of the model (it returns None: gradients and the
all-reduce are untouched, so training results are bit-identical, and it works whether the
model is wrapped in DistributedDataParallel before or after State, and next to a communication
hook of the program's own); the first hook of a backward pass queues a callback on the autograd
engine, which queues a second one: autograd runs callbacks in order, so the second runs after
DDP's own end-of-backward callback (queued when its last bucket was launched), which waits for
the all-reduce. Each measured step adds its nanoseconds to the rank's progress slot
(progress_board.h) as a running total the agent samples.

A collective outside backward (the Horovod layer's optimizer reduces the gradients in step())
tells its waits to waited(): the waits between the previous backward's end and this step's
gradients ready are taken off the compute time.

Not measured: the first backward pass of a process (no previous end), a program whose
collective is outside backward and does not say its waits (a hand-written all-reduce), and
programs without State that do not call efdl.watch_compute(model).
"""

import time
import weakref

_watched = weakref.WeakKeyDictionary()   # module -> its Timer (one per model)
# Nanoseconds this process waited in collectives outside backward (the Horovod layer's), a
# running total the Timers read at their marks.
_waits = [0]


def waited(ns):
    """A collective outside backward waited `ns` for its peers (not compute time)."""
    _waits[0] += ns


class Timer:
    """Times one model's backward passes; `sink(compute_ns)` gets each measured step."""

    def __init__(self, sink):
        self._sink = sink
        self._ready = 0        # monotonic ns of the last gradient hook in this backward pass
        self._end = 0          # monotonic ns at the end of the previous backward pass
        self._ready_waits = 0  # _waits at those two moments
        self._end_waits = 0
        self._queued = False
        self._handles = []

    def attach(self, module):
        for p in module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._on_grad))
        # A backward pass that raised never runs its callbacks: the next forward pass starts
        # the count again, so the measurement does not stop for good.
        self._handles.append(module.register_forward_pre_hook(self._on_forward))

    def _on_forward(self, module, inputs):
        self._queued = False

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_grad(self, grad):
        self._ready = time.monotonic_ns()
        self._ready_waits = _waits[0]
        if not self._queued:
            self._queued = True
            try:
                from torch.autograd import Variable
                Variable._execution_engine.queue_callback(self._after_callbacks)
            except (ImportError, AttributeError, RuntimeError):
                self._queued = False
        return None

    def _after_callbacks(self):
        from torch.autograd import Variable
        Variable._execution_engine.queue_callback(self._on_end)

    def _on_end(self):
        end = time.monotonic_ns()
        self._queued = False
        if self._end and self._ready > self._end:
            self._sink(max(0, self._ready - self._end - (self._ready_waits - self._end_waits)))
        self._end = end
        self._end_waits = _waits[0]


def watch(module, sink):
    """Times `module`'s backward passes into `sink` (once per module; a DDP wrapper's inner
    module is the same). Returns its Timer, or None when `module` has no parameters."""
    inner = getattr(module, "module", module)
    t = _watched.get(inner)
    if t is not None:
        return t
    if not any(p.requires_grad for p in inner.parameters()):
        return None
    t = Timer(sink)
    t.attach(inner)
    _watched[inner] = t
    return t
