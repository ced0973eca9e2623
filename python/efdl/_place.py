"""A round's place: where this process stands in one round of the job (issue #31 step 3).

The agent decides a worker's place (src/agent/worker_env.cc builds its environment) and hands it
over either at the process' start, as its environment, or - to a worker under efdl.elastic.run
that keeps its process across rounds - as a `round` line on the control socket (typed `round`,
`rank`, `local_rank` besides `env`, docs/control-protocol.md). Both arrive here as one value, a
RoundPlace, and one function, apply(), makes a place the process' own:

- the process environment gets the place's variables (torch's env:// initialisation, efdl._dist
  and the user's program read RANK, WORLD_SIZE, MASTER_ADDR, EFDL_ROUND ... there);
- the control client holds the place (ControlClient.place): its `round`, `rank` and `local_rank`
  are read from it, and it is the home of the round number. The environment's EFDL_ROUND is the
  copy that apply() writes for programs; InProcessRounds (efdl/_rounds.py) records the round in
  which its State agreed and compares it with current(), never keeping a round of its own.

Imports nothing of efdl but _env and the generated names, and not torch: the control client,
which runs in forking contexts, uses it. Integers of the environment are parsed by _env only.
"""

import os
import types

from efdl import _env
from efdl._names import Env


def int_or(value, default):
    """`value` (of a control message) as an int, `default` when it is not one."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class RoundPlace:
    """One round's place of this process: `round` (None: not placed by an agent, no EFDL_ROUND),
    the global `rank`, the `local_rank` on its node, the `world_size` (None: not known) and `env`,
    the variables a worker started for that round gets (a read-only mapping of strings; empty
    for a place read from the environment, which already holds them). A value: never changed."""

    __slots__ = ("round", "rank", "local_rank", "world_size", "env")

    def __init__(self, round_, rank, local_rank, world_size=None, env=None):
        set_ = object.__setattr__
        set_(self, "round", round_)
        set_(self, "rank", rank)
        set_(self, "local_rank", local_rank)
        set_(self, "world_size", world_size)
        set_(self, "env", types.MappingProxyType(dict(env or {})))

    def __setattr__(self, name, value):
        raise AttributeError("a RoundPlace is a value: make a new one instead of setting %s"
                             % name)

    @classmethod
    def from_message(cls, message, fallback):
        """The place a control `round` message gives, or None when it carries no environment.
        Its typed `rank` / `local_rank` (an agent since #31 step 3) are taken first, else the
        environment's RANK / LOCAL_RANK (an older agent), else `fallback`'s (the place held)."""
        env = message.get("env")
        if not isinstance(env, dict):
            return None
        env = {str(k): str(v) for k, v in env.items()}
        return cls(int(message["round"]),
                   int_or(message.get("rank", env.get(Env.RANK)), fallback.rank),
                   int_or(message.get("local_rank", env.get(Env.LOCAL_RANK)),
                           fallback.local_rank),
                   int_or(env.get(Env.WORLD_SIZE), None), env)

    @classmethod
    def from_environment(cls, default_round=None, message=None, error=ValueError):
        """The place this process' environment holds (the agent's at its start, or the last one
        applied). Unset or empty: rank 0 of 1 and `default_round`; any other value, blanks too,
        must be an integer (else `error` with `message`, _env.env_int's rules)."""
        def read(name, default):
            return _env.env_int(name, default, strip=False, blank_is_default=False,
                                message=message, error=error)
        return cls(read(Env.ROUND, default_round), read(Env.RANK, 0), read(Env.LOCAL_RANK, 0),
                   read(Env.WORLD_SIZE, 1))

    def environment(self):
        """The variables apply() writes: `env`, with the typed fields over its own."""
        env = dict(self.env)
        if self.round is not None:
            env[Env.ROUND] = str(self.round)
        env[Env.RANK] = str(self.rank)
        env[Env.LOCAL_RANK] = str(self.local_rank)
        if self.world_size is not None:
            env[Env.WORLD_SIZE] = str(self.world_size)
        return env

    def __eq__(self, other):
        if not isinstance(other, RoundPlace):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self):
        return hash((self.round, self.rank, self.local_rank, self.world_size))

    def __repr__(self):
        return "RoundPlace(round=%r, rank=%r, local_rank=%r, world_size=%r, %d variables)" % (
            self.round, self.rank, self.local_rank, self.world_size, len(self.env))


def apply(place, control=None):
    """Makes `place` this process' own: its variables go into the process environment, and the
    control client (if any) holds it. The one way a place is taken (module docstring)."""
    os.environ.update(place.environment())
    if control is not None:
        control.place = place


def current(control=None):
    """The place this process holds now: its control client's (the agent's link, the only way a
    place changes in a running process), else the one its environment gave it at start."""
    if control is not None:
        return control.place
    return RoundPlace.from_environment()
