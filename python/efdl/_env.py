"""The process' environment: where it stands in the job, and the one parser of integer and flag
variables that every module of the package uses.

The agent (`efdl run`) gives every worker RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (the torchrun names, so unmodified torch programs run too). A process
started without them is a 1-process job: rank 0 of 1. Pure functions of os.environ; no state.
Imports nothing of efdl but the generated names (_names.py, from src/common/env_names.h) and not
torch, so every module may use it (the control client too).
"""

import os

try:
    from efdl._names import Env
except ModuleNotFoundError as e:
    if e.name != "efdl._names":
        raise
    # The first efdl module every import of the package loads: say once what is missing.
    raise ImportError("efdl/_names.py is missing: the build writes it (from src/common/"
                      "env_names.h) next to the compiled module; build the source tree "
                      "(make, or cmake --build build) or install efdl with `make install`"
                      ) from None

# How a value that is not an integer is reported (a %-format of the dict with "name", "value"
# and "minimum"). Each caller keeps the words it always had.
NOT_AN_INTEGER = "environment variable %(name)s=%(value)r is not an integer"
NOT_AN_INTEGER_WITH_MINIMUM = ("environment variable %(name)s=%(value)r is not an integer; unset "
                               "it or set it to an integer >= %(minimum)d")


def env_int(name, default, minimum=None, *, strip=True, blank_is_default=True, message=None,
            error=ValueError):
    """os.environ[name] as an int, or `default` when it is unset or empty.

    strip: the value loses surrounding blanks before it is parsed and reported (EFDL_* settings);
    False: it is parsed and reported as set. blank_is_default: a value of blanks only counts as
    unset; False: it is not an integer (the control client's RANK, EFDL_ROUND).

    A value that is not an integer raises `error` with one line naming the variable: `message`,
    by default NOT_AN_INTEGER, or NOT_AN_INTEGER_WITH_MINIMUM when a minimum is given. With a
    minimum, a smaller integer raises ValueError ("... must be >= minimum")."""
    value = os.environ.get(name, "")
    if strip:
        value = value.strip()
    if value == "" or (blank_is_default and value.isspace()):
        return default
    try:
        number = int(value)
    except ValueError:
        if message is None:
            message = NOT_AN_INTEGER if minimum is None else NOT_AN_INTEGER_WITH_MINIMUM
        raise error(message % {"name": name, "value": value, "minimum": minimum}) from None
    if minimum is not None and number < minimum:
        raise ValueError("environment variable %s=%d must be >= %d" % (name, number, minimum))
    return number


def launcher_int(name, default, minimum=0):
    """A launcher's variable (RANK, WORLD_SIZE, HOROVOD_*, ...) as an int >= minimum, `default`
    when unset or blank; read as set, and a bad value is reported with what to do about it."""
    return env_int(name, default, minimum, strip=False)


def env_flag(name, default=False, words=None, normalize=True):
    """os.environ[name] as a flag; `default` when it is unset.

    words None: an integer flag by env_int's rules (unset or blank: `default`; not an integer:
    ValueError), on when not 0. words: on when the value is one of them, compared without
    surrounding blanks and in lower case (normalize=False: exactly as set); any other value,
    empty included, is off."""
    if words is None:
        return env_int(name, 1 if default else 0) != 0
    value = os.environ.get(name)
    if value is None:
        return default
    return (value.strip().lower() if normalize else value) in words


def rank():
    return launcher_int(Env.RANK, 0)


def world_size():
    return launcher_int(Env.WORLD_SIZE, 1, minimum=1)


def local_rank():
    return launcher_int(Env.LOCAL_RANK, 0)


def local_world_size():
    return launcher_int(Env.LOCAL_WORLD_SIZE, 1, minimum=1)


def has_launcher_env():
    """True when a launcher (the agent, torchrun, a platform) placed this process in a group."""
    return Env.RANK in os.environ and Env.WORLD_SIZE in os.environ


def under_agent():
    """True when this process was started by an EFDL agent (it always sets these two)."""
    return Env.CONTROL_SOCKET in os.environ or has_launcher_env()
