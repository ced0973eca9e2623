"""A round's place as one value (efdl/_place.py, issue #31 step 3): read from the agent's
`round` control message (with the typed fields of a current agent, or only the environment of
an older one) and from the process environment, and applied to the process by one function.

The control client's use of it against a scripted agent is in test_control_client.py; a worker
taking places across real rounds in test_e2e_elastic_run.py.
"""

import os

import pytest

from efdl import _place, control
from efdl._place import RoundPlace

_HELD = RoundPlace(4, 2, 0, 4)   # the place a worker holds before the message


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "EFDL_ROUND", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_message_with_typed_fields_gives_them_first():
    # The typed rank and local rank are what the agent decided; the environment does not repeat
    # them here, so a place built from the environment alone would keep the held ones.
    message = {"type": "round", "round": 5, "rank": 7, "local_rank": 1,
               "env": {"WORLD_SIZE": 8, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}}
    place = RoundPlace.from_message(message, _HELD)
    assert (place.round, place.rank, place.local_rank, place.world_size) == (5, 7, 1, 8)
    assert place.env == {"WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_a_message_of_an_older_agent_gives_the_environments_ranks_else_the_held_ones():
    older = {"type": "round", "round": "6", "env": {"RANK": "3", "LOCAL_RANK": "1"}}
    place = RoundPlace.from_message(older, _HELD)
    assert (place.round, place.rank, place.local_rank, place.world_size) == (6, 3, 1, None)
    bare = RoundPlace.from_message({"type": "round", "round": 7, "env": {}}, _HELD)
    assert (bare.round, bare.rank, bare.local_rank) == (7, 2, 0)
    assert RoundPlace.from_message({"type": "round", "round": 8}, _HELD) is None, \
        "a round message without an environment is no place"


def test_the_environment_gives_the_place_a_process_starts_with(clean_env):
    assert RoundPlace.from_environment() == RoundPlace(None, 0, 0, 1), "not placed by an agent"
    clean_env.setenv("EFDL_ROUND", "3")
    clean_env.setenv("RANK", "5")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("WORLD_SIZE", "6")
    assert RoundPlace.from_environment() == RoundPlace(3, 5, 1, 6)
    assert _place.current() == RoundPlace(3, 5, 1, 6), "without a control client: the environment"
    clean_env.setenv("RANK", " ")
    with pytest.raises(ValueError, match="RANK=' ' is not an integer"):
        RoundPlace.from_environment()
    with pytest.raises(control.ControlError, match="^RANK=' ' is not an integer$"):
        RoundPlace.from_environment(message="%(name)s=%(value)r is not an integer",
                                    error=control.ControlError)


def test_apply_writes_the_place_into_the_process_environment(clean_env):
    message = {"type": "round", "round": 9, "rank": 4, "local_rank": 0,
               "env": {"RANK": "4", "WORLD_SIZE": "5", "EFDL_ROUND": "9",
                       "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29501"}}
    place = RoundPlace.from_message(message, _HELD)
    _place.apply(place)
    assert {k: os.environ[k] for k in ("EFDL_ROUND", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT")} == {
        "EFDL_ROUND": "9", "RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "5",
        "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29501"}
    assert RoundPlace.from_environment() == RoundPlace(9, 4, 0, 5), \
        "the environment now holds the applied place"


def test_a_place_is_a_value():
    place = RoundPlace(1, 0, 0, 1, {"RANK": "0"})
    with pytest.raises(AttributeError, match="a RoundPlace is a value"):
        place.round = 2
    with pytest.raises(TypeError):
        place.env["RANK"] = "1"
    assert place == RoundPlace(1, 0, 0, 1, {"RANK": "0"}) and place != RoundPlace(2, 0, 0, 1)
