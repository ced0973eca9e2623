"""Where to resume an epoch after a restart, possibly at another world size.

Two ways (docs/data-and-resume.md has the full derivation and the tested claims):

1. The spec's loop (EFDL-SPEC 3.4) keeps `state.step` = index of the last batch this rank finished
   in the epoch (the loop commits after batch `step`) and recomputes it after a resize with
   resume_step(); the sampler then starts at `start_index = step * batch_size` per rank. Measured
   against the committed model, and with B = batch size, W1 / W2 = old / new world size:
     - nothing is ever lost, except what drop_last drops by design at the new world size (fewer
       than W2 samples at the end of the epoch order, as torch drops fewer than W at a fixed size);
     - W2 != W1 and step >= 1: B * ((step + 1) * W1 mod W2) samples are trained twice, fewer than
       one batch per new replica;
     - W2 == W1 (no recompute): the committed batch is trained twice, exactly one batch per
       replica (B * W1 samples), because the sampler restarts at step, not step + 1;
     - W2 != W1 and step == 0: the formula is skipped (`state.step != 0` guard) and the first
       global batch, B * W1 samples, is trained twice: W1 / W2 batches per new replica, more than
       one when the job shrank.

2. Exact: keep the job-wide count of samples consumed in the epoch in the State
   (`state.samples += len(batch) * world_size` per step, 0 at an epoch start) and give it to the
   sampler as `global_start_index`. exact_resume() turns that count into the sampler position and
   the step number to continue counting from. Nothing is lost or repeated, across any number of
   resizes within an epoch (again apart from drop_last's tail at the final world size).
"""

import collections

ResumePoint = collections.namedtuple("ResumePoint", ["step", "global_start_index"])


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s=%r must be a positive integer" % (name, value))


def resume_step(step, old_world_size, new_world_size):
    """The spec's recomputation of `state.step` after the world size changed.

    `step` is the index of the last batch finished in the epoch (what the spec's loop commits).
    Returns floor((step + 1) * old / new) when the size changed and step != 0, else `step`,
    exactly as the spec's loop does; see the module docstring for what it repeats.
    """
    _positive("old_world_size", old_world_size)
    _positive("new_world_size", new_world_size)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError("step=%r must be an integer >= 0" % (step,))
    if old_world_size == new_world_size or step == 0:
        return step
    return (step + 1) * old_world_size // new_world_size


def exact_resume(samples, batch_size, world_size):
    """Resume point from the job-wide count of samples consumed in the current epoch.

    `samples`: sum over the steps done of len(batch) * world size at that step (the State keeps
    it). Returns ResumePoint(step, global_start_index): give `global_start_index` to
    efdl.data.DistributedSampler; `step` = whole global batches of `batch_size * world_size`
    consumed, for counting steps onward (logging, commit intervals) - it does not position data.
    """
    _positive("batch_size", batch_size)
    _positive("world_size", world_size)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError("samples=%r must be an integer >= 0" % (samples,))
    return ResumePoint(step=samples // (batch_size * world_size), global_start_index=samples)
