"""In-process round changes of a State (efdl.backend.torch.elastic.run; docs/user-guide.md,
"Recovery without restart"): a collaborator of State, which holds one (`State._rounds`) and
serves it through the explicit interface RoundsHost.

Under elastic.run a worker keeps its process from one round to the next. The rounds then:

- at a pause (the agent's "pause", or a stop that the ranks agreed on because some peer was asked
  to stop) - once the State took the snapshot of the current step as at a graceful stop - raise
  the host's round-change exception instead of exiting (pause, from State.commit());
- when the round is left (leave) drop what belongs to the old process group: the host's stop
  vote and its all-reduce in flight; after a failed collective the state in memory no longer
  counts (a step may be half applied);
- once the next round's process group exists (sync) make every rank agree on one snapshot, with
  the same decision as a State constructed in a new round (the newest some rank holds; ranks
  lacking it receive it from a holder), and restore it - except on a rank whose memory already
  is that snapshot (it paused right after taking it, or it is a new process that restored it at
  construction): there nothing is copied. A new process whose State was built after the round's
  process group (hvd.init() at the top of a Horovod program) agreed in its constructor already,
  in step with the other ranks' agreement here: it does not agree twice;
- run the reset callbacks the program registered.
"""

import abc
import weakref

from efdl import _agreement, _place, _progress


class RoundChangeInterrupt(Exception):
    """Raised by State.commit() under elastic.run when the round changes: the snapshot of the
    current step is taken; elastic.run catches it and continues in the next round."""


class RoundsHost(abc.ABC):
    """What InProcessRounds needs from the state it serves: efdl.State implements it. The names
    are protected (one underscore) because a State's public attribute names are the program's
    own values. `_round_change` is the hook a subclass may override (hvd.elastic.TorchState
    raises Horovod's HostsUpdatedInterrupt)."""

    @abc.abstractmethod
    def _held_snapshots(self):
        """(ref, meta) of every snapshot this node holds that can be restored, newest first."""

    @abc.abstractmethod
    def _agreed_snapshot(self, world):
        """(ref, meta, own_newest) the ranks of a round of `world` agree on, or None when no
        rank has one; ranks that lack it receive it. Collective over the default group."""

    @abc.abstractmethod
    def _adopt_all(self, ref, meta):
        """Makes `ref` the state: the keyword values and every part given (model, ...)."""

    @abc.abstractmethod
    def _restored_step(self):
        """The step of the snapshot the state was last restored from (None: none)."""

    @abc.abstractmethod
    def _forget_stop_vote(self):
        """Drops the stop agreement of the round's process group (it is being destroyed)."""

    def _agreement_world(self):
        """The number of ranks that agree on the state (0: this rank decides alone)."""
        return _agreement.group_size()

    def _round_change(self, step):
        """The exception that ends a round at a pause (commit() raises it at `step`)."""
        return RoundChangeInterrupt("round change at step %s" % (step,))

    def _on_round_synced(self):
        """Called once the ranks of a new round agreed on the state (sync)."""

    def _round_place(self):
        """The RoundPlace this process holds now (efdl/_place.py; State: its control client's)."""
        return _place.current()


class InProcessRounds:
    """In-process round changes of one State (see the module docstring). Holds its host weakly:
    the State is freed (and flushes in its __del__) as soon as the program drops it."""

    def __init__(self, host):
        self._host = weakref.proxy(host)
        self.in_process = False   # set by elastic.run
        # The state in memory is the newest snapshot this rank can offer (or a fresh start):
        # a process that restored at construction, or that paused right after its snapshot.
        self.mem_clean = True
        self.reset_callbacks = []
        # The round whose process group the State agreed in at construction (a program that
        # creates the group before the State, as hvd.init() at the top of a Horovod program).
        # A record of a past fact, not a second home of the round number: the round this
        # process is in is always the host's place (efdl/_place.py), read at each use.
        self.agreed_round = None

    def add_reset_callbacks(self, callbacks):
        """State.register_reset_callbacks (its docstring)."""
        if callable(callbacks):
            callbacks = [callbacks]
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError("register_reset_callbacks needs callables, got %r" % (cb,))
        self.reset_callbacks.extend(callbacks)

    def agreed_at_construction(self):
        """The State agreed on its snapshot with the ranks of this process group (this round)."""
        self.agreed_round = self._host._round_place().round

    def pause(self, step):
        """The round ends at `step`, whose snapshot is taken: raises the host's exception."""
        self.mem_clean = True
        raise self._host._round_change(step)

    def leave(self, clean):
        """The worker leaves its round's process group: `clean` when it paused after a snapshot,
        False after a failed collective (the state goes back to the agreed snapshot)."""
        self._host._forget_stop_vote()
        if not clean:
            self.mem_clean = False

    def run_reset_callbacks(self):
        for cb in self.reset_callbacks:
            cb()

    def sync(self):
        """Every rank of the new round's process group agrees on the state (collective). Returns
        the step the round continues from (None: a fresh start)."""
        step = self._agree()
        self._host._on_round_synced()
        _progress.restored()   # the goodput ledger: the round's first step begins
        return step

    def _agree(self):
        host = self._host
        world = host._agreement_world()
        agreed, self.agreed_round = self.agreed_round, None
        if world and agreed is not None and agreed == self._host._round_place().round:
            # Constructed in this round's group: its constructor's agreement was this round's
            # (it paired with the other ranks' agreement here); nothing changed since.
            return host._restored_step()
        if world:
            chosen = host._agreed_snapshot(world)
        elif not self.mem_clean:
            chosen = next(((ref, meta, False) for ref, meta in host._held_snapshots()), None)
        else:
            chosen = None
        if chosen is not None:
            ref, meta, held = chosen
            if not (held and self.mem_clean):
                host._adopt_all(ref, meta)
        self.mem_clean = True
        if chosen is None:
            return host._restored_step()
        return chosen[0].step

    def restore_held(self):
        """Goes back to the newest snapshot this node holds (none: nothing changes)."""
        for ref, meta in self._host._held_snapshots():
            self._host._adopt_all(ref, meta)
            return
