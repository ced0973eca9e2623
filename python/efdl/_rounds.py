"""State's part in in-process round changes (efdl.backend.torch.elastic.run; docs/user-guide.md,
"Recovery without restart").

Under elastic.run a worker keeps its process from one round to the next. State then:

- at a pause (the agent's "pause", or a stop that the ranks agreed on because some peer was asked
  to stop) takes the snapshot of the current step as at a graceful stop and raises
  RoundChangeInterrupt instead of exiting (_pause_now, from commit());
- when the round is left (_leave_round) drops what belongs to the old process group: the stop
  vote and its all-reduce in flight; after a failed collective the state in memory no longer
  counts (a step may be half applied);
- once the next round's process group exists (_sync_round) makes every rank agree on one
  snapshot, with the same decision as a State constructed in a new round (the newest some rank
  holds; ranks lacking it receive it from a holder), and restores it - except on a rank whose
  memory already is that snapshot (it paused right after taking it, or it is a new process that
  restored it at construction): there nothing is copied. A new process whose State was built
  after the round's process group (hvd.init() at the top of a Horovod program) agreed in its
  constructor already, in step with the other ranks' agreement here: it does not agree twice.

A mixin of State (efdl/state.py), which owns everything it uses.
"""

import os

from efdl import _agreement
from efdl._names import Env

_PARTS = ("model", "optimizer", "scheduler")


class RoundChangeInterrupt(Exception):
    """Raised by State.commit() under elastic.run when the round changes: the snapshot of the
    current step is taken; elastic.run catches it and continues in the next round."""


class InProcessRounds:
    """In-process round changes of State (see the module docstring)."""

    def _init_rounds(self):
        self._in_process = False   # set by elastic.run
        # The state in memory is the newest snapshot this rank can offer (or a fresh start):
        # a process that restored at construction, or that paused right after its snapshot.
        self._mem_clean = True
        self._reset_callbacks = []
        # The round whose process group this State agreed in at construction (a program that
        # creates the group before the State, as hvd.init() at the top of a Horovod program).
        self._agreed_round = None

    def register_reset_callbacks(self, callbacks):
        """Functions called without arguments under efdl.elastic.run after every in-process
        round change, once the ranks agreed on the state and before the training function runs
        again (e.g. to scale the learning rate with the new world size); also in a new process
        whose state was restored from a snapshot (it joined a running job), never at a fresh
        start."""
        if callable(callbacks):
            callbacks = [callbacks]
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError("register_reset_callbacks needs callables, got %r" % (cb,))
        self._reset_callbacks.extend(callbacks)

    def _pause_now(self, step):
        self._mem_clean = True
        raise RoundChangeInterrupt("round change at step %s" % (step,))

    def _leave_round(self, clean):
        """The worker leaves its round's process group: `clean` when it paused after a snapshot,
        False after a failed collective (the state goes back to the agreed snapshot)."""
        vote = self._vote
        if vote is not None:
            vote.abandon()
        self._vote = None
        self._vote_checked = False
        if not clean:
            self._mem_clean = False

    def _run_reset_callbacks(self):
        for cb in self._reset_callbacks:
            cb()

    def _sync_round(self):
        """Every rank of the new round's process group agrees on the state (collective). Returns
        the step the round continues from (None: a fresh start)."""
        given = [p for p in _PARTS if getattr(self, p) is not None]
        world = _agreement.group_size()
        agreed, self._agreed_round = self._agreed_round, None
        if world and agreed is not None and agreed == os.environ.get(Env.ROUND):
            # Constructed in this round's group: its constructor's agreement was this round's
            # (it paired with the other ranks' agreement here); nothing changed since.
            ref = self._restored
            return None if ref is None else ref.step
        if world:
            chosen = self._agreed_snapshot(world)
        elif not self._mem_clean:
            chosen = next(((ref, meta, False) for ref, meta in self._usable_local()), None)
        else:
            chosen = None
        if chosen is not None:
            ref, meta, held = chosen
            if not (held and self._mem_clean):
                self._adopt(ref, meta)
                if given:
                    self._restore_parts(given)
        self._mem_clean = True
        ref = self._restored if chosen is None else chosen[0]
        return None if ref is None else ref.step

    def _usable_local(self):
        for ref in self._engine.candidates():
            meta = self._usable_meta(ref)
            if meta is not None:
                yield ref, meta
