"""Where this process stands in the job, read from the environment the agent provides.

The agent (`efdl run`) gives every worker RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (the torchrun names, so unmodified torch programs run too). A process
started without them is a 1-process job: rank 0 of 1. Pure functions of os.environ; no state.
"""

import os


def env_int(name, default, minimum=0):
    """os.environ[name] as an int >= minimum, or `default` when unset or empty.

    Raises ValueError with one line naming the variable when the value is not such an int.
    """
    value = os.environ.get(name, "")
    if value.strip() == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError("environment variable %s=%r is not an integer; unset it or set it to "
                         "an integer >= %d" % (name, value, minimum)) from None
    if number < minimum:
        raise ValueError("environment variable %s=%d must be >= %d" % (name, number, minimum))
    return number


def rank():
    return env_int("RANK", 0)


def world_size():
    return env_int("WORLD_SIZE", 1, minimum=1)


def local_rank():
    return env_int("LOCAL_RANK", 0)


def local_world_size():
    return env_int("LOCAL_WORLD_SIZE", 1, minimum=1)


def has_launcher_env():
    """True when a launcher (the agent, torchrun, a platform) placed this process in a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def under_agent():
    """True when this process was started by an EFDL agent (it always sets these two)."""
    return "EFDL_CONTROL_SOCKET" in os.environ or has_launcher_env()
