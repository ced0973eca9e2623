"""A pre-started worker of `efdl run` (started by the agent, not by users; the default for a
python worker command, `--no-prestart` turns it off).

`python3 [options] -m efdl.preload FD [READY_FD]` imports the modules named in EFDL_PRELOAD_MODULES
(comma-separated; default torch, torch.distributed and efdl.backend.torch), then blocks reading
the pipe FD until the agent writes one JSON message and closes it: {"round": N, "argv": [...], "env": {...}}.
"argv" is the program part of the worker command (`script.py ARGS` or `-m module ARGS`) and
"env" the complete environment a freshly spawned worker of that round would have. The process
then becomes that worker: os.environ, sys.argv, sys.path[0] and a fresh __main__ module are set
as `python3 script.py` / `python3 -m module` would set them, and the program runs. Its exit
status, signals, and the traceback of an uncaught exception (exit status 1) are the program's.

When READY_FD is given, one byte is written to it and it is closed once the imports are done: a
starting agent joins the job only then (docs/agent.md, "Pre-started workers").

The pipe is read once, so a spare serves one round at most. End of file without a message (the
agent died or discarded the spare) ends the process without running anything.

`python3 [options] -m efdl.preload --zygote SOCK_FD` is the node's zygote (the default): it does
the imports once and then forks one spare per request on SOCK_FD, so a spare is ready within
milliseconds and shares the zygote's pages. The protocol and what a fork inherits are described
in src/agent/zygote.h, which owns them; docs/agent.md, "Pre-started workers", for users.

Where the worker's interpreter cannot import efdl by itself, the agent starts the zygote (and a
started spare) with the package's directory in front of PYTHONPATH and in EFDL_PRELOAD_PATH;
main() takes it out of sys.path and PYTHONPATH again before anything else is imported, so the
program sees the path its interpreter gives it (src/agent/zygote.h, "Where the zygote finds
efdl").
"""

import builtins
import importlib
import importlib.machinery
import json
import os
import signal
import sys
import sysconfig
import time
import types

from efdl._names import Env

DEFAULT_MODULES = "torch,torch.distributed,efdl.backend.torch"
# A worker forked from the zygote reports the installed modules its program imported in a file
# here at its exit (src/agent/zygote.h, "Learning the program's imports").
IMPORTS_DIR_ENV = Env.IMPORTS_DIR   # src/agent/zygote.h kImportsDirVariable
# The package directory the agent put in front of PYTHONPATH for this process alone, when the
# worker's interpreter cannot import efdl by itself (src/agent/zygote.h, "Where the zygote finds
# efdl").
PRELOAD_PATH_ENV = Env.PRELOAD_PATH   # src/agent/zygote.h kPreloadPathVariable
_MAX_REPORTED = 5000
# Reports are written this long after the program started, by a daemon thread (a program
# stopped by SIGTERM at a round change never reaches its exit), and at its exit. The first
# comes early, for the next round change; the second catches imports of a slower start-up.
_REPORT_AFTER_S = (2.0, 30.0)
_modules_before_program = None   # set(sys.modules) when the program started (forked spares)


def _forget_preload_path():
    """Takes the agent's package directory (PRELOAD_PATH_ENV) out of sys.path and PYTHONPATH
    again. `efdl` is imported by now (`-m efdl.preload` imported the package first), and its
    submodules are found through the package's own __path__: nothing else may come from that
    directory, so the program - and the modules the zygote learns from it - see the path their
    interpreter gives them."""
    entry = os.environ.pop(PRELOAD_PATH_ENV, None)
    if not entry:
        return
    for i, p in enumerate(sys.path):
        if i > 0 and p and os.path.abspath(p) == os.path.abspath(entry):
            del sys.path[i]
            break
    rest = os.environ.get(Env.PYTHONPATH, "")
    if rest == entry:
        del os.environ[Env.PYTHONPATH]
    elif rest.startswith(entry + os.pathsep):
        os.environ[Env.PYTHONPATH] = rest[len(entry) + 1:]


def _preload(names):
    _import_all(filter(None, (n.strip() for n in names.split(","))))


def _import_all(names):
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the program reports it, if it needs the module at all
        except Exception as e:  # noqa: BLE001 - a broken import must not stop the worker
            print("efdl.preload: importing %s failed: %s" % (name, e), file=sys.stderr)


def _read_message(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    if not chunks:
        return None
    return json.loads(b"".join(chunks))


def _fresh_main():
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    return main


def _run_script(path, args):
    sys.argv = [path] + args
    full = os.path.abspath(path)
    if os.path.isdir(path) or not path.endswith(".py") and _is_zip(path):
        import runpy
        sys.path[0] = path
        runpy.run_path(path, run_name="__main__")
        return
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        print("%s: can't open file %r: [Errno %d] %s"
              % (sys.orig_argv[0], full, e.errno, e.strerror), file=sys.stderr)
        sys.exit(2)
    # As CPython does for a script: its real directory first on the path, __file__ absolute.
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    code = compile(source, full, "exec", dont_inherit=True)
    main = _fresh_main()
    main.__file__ = full
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", full)
    exec(code, main.__dict__)


def _is_zip(path):
    import zipfile
    return zipfile.is_zipfile(path)


def _run_module(name, args):
    import runpy
    sys.argv = ["-m"] + args
    sys.path[0] = os.getcwd()
    _fresh_main()
    # What `python3 -m` itself calls.
    runpy._run_module_as_main(name, alter_argv=True)


def _serve(fd, ready):
    """The life of a spare after its imports: report them done on `ready` (if any), wait for
    the round's message on `fd`, become the worker. Returns the exit status."""
    if ready is not None:
        try:
            os.write(ready, b"1")
        except OSError:
            pass  # the agent stopped waiting (it already joined, or it is gone)
        os.close(ready)
    msg = _read_message(fd)
    if msg is None:
        return 0
    env = msg["env"]
    # The interpreter added LC_CTYPE at start-up (PEP 538 locale coercion) if the environment,
    # which differs from the program's only in per-round variables, asked for it: a fresh
    # interpreter of the program would have added it too.
    coerced = os.environ.get("LC_CTYPE") if "LC_CTYPE" not in env else None
    os.environ.clear()
    os.environ.update(env)
    if coerced is not None:
        os.environ["LC_CTYPE"] = coerced
    argv = list(msg["argv"])
    set_worker_title()
    # Hang detection (issue #32): this process' stacks go where its agent reads them.
    from efdl import _progress
    _progress.arm_stack_dump()
    global _modules_before_program
    _modules_before_program = set(sys.modules)
    if os.environ.get(IMPORTS_DIR_ENV):
        import threading
        threading.Thread(target=_report_imports_later, name="efdl-imports-report",
                         daemon=True).start()
    try:
        if argv[0] == "-m":
            _run_module(argv[1], argv[2:])
        else:
            _run_script(argv[0], argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - reported exactly like the interpreter does
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        e.__traceback__ = tb  # the interpreter prints the exception's own traceback
        sys.excepthook(type(e), e, tb)
        return 1
    return 0


# --- The zygote (src/agent/zygote.h owns the protocol) ---

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
ZYGOTE_NAME = b"efdl-zygote"   # its name in ps -o comm (src/agent/zygote.h)
_ADOPTION_TIMEOUT_S = 2.0


def _prctl(option, arg):
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def worker_title():
    """What ps shows for a worker forked from the zygote: its job, node and rank."""
    env = os.environ
    # The rank first: an interpreter's argument area may hold only the first few dozen bytes.
    return "efdl-worker rank=%s node=%s job=%s round=%s" % (
        env.get(Env.RANK, "?"), env.get(Env.NODE_ID, "?"), env.get(Env.JOB_ID, "?"),
        env.get(Env.ROUND, "?"))


def set_worker_title():
    """Names this process after worker_title(), else every forked worker reads as the zygote
    (`python3 -m efdl.preload --zygote N`) in ps. `ps -o comm` (15 bytes, prctl PR_SET_NAME):
    `efdl-rank<RANK>`. `ps -o args` (/proc/PID/cmdline): the title, cut to the size of the
    interpreter's original argument area, which it overwrites through /proc/self/mem (its bounds
    are fields arg_start/arg_end of /proc/self/stat); where that is refused, args stay as they
    were. Called again at each in-process round change (the rank may change)."""
    try:
        _prctl(_PR_SET_NAME, ("efdl-rank%s" % os.environ.get(Env.RANK, "?")).encode()[:15])
    except OSError:
        pass
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Fields after the ")" closing comm; arg_start and arg_end are fields 48 and 49.
        fields = stat[stat.rindex(b")") + 2:].split()
        start, end = int(fields[48 - 3]), int(fields[49 - 3])
        if end - start < 2:
            return
        title = worker_title().encode()[:end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(title + b"\0" * (end - start - len(title)))
    except (OSError, ValueError, IndexError):
        pass


def _send(sock, **fields):
    sock.send(json.dumps(fields).encode())


def _threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _cuda_initialized():
    """Whether torch initialised CUDA in this process (a fork of it could not use CUDA). A
    library that initialises the driver itself starts its threads, which _threads() sees."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without a usable cuda module has no CUDA state
        return False


class _Spare:
    """What the zygote's code returns in a forked spare: the request it was forked for, and the
    process name the interpreter had before it became the zygote."""

    def __init__(self, env, fds, name, middle):
        self.env = env
        self.fds = fds
        self.name = name
        self.middle = middle   # the intermediate process, our parent until it exits


def _become_spare(spare, agent):
    """In the forked spare, out of the zygote's loop: wait to be adopted by the agent, take the
    descriptors and environment of the request, and return the spare's (message, ready) fds."""
    message_fd, ready_fd, out_fd, err_fd = spare.fds
    os.setpgid(0, 0)
    # The intermediate process exits at once, and the agent (a child subreaper) adopts us.
    deadline = time.monotonic() + _ADOPTION_TIMEOUT_S
    while os.getppid() == spare.middle and time.monotonic() < deadline:
        time.sleep(0.0002)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent:   # not adopted (the agent is gone): nobody would wait for us
        os._exit(1)
    _flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    os.environ.update(spare.env)
    _prctl(_PR_SET_NAME, spare.name)   # a worker, as ps shows a started one
    # What differs from a fresh interpreter: `random` is reseeded by its own fork hook;
    # numpy's global generator, seeded at import, is not.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    return message_fd, ready_fd


def _flush():
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            pass


def _can_leave_idle():
    """Whether this process may return from SCHED_IDLE to SCHED_OTHER (CAP_SYS_NICE, or an
    RLIMIT_NICE that allows nice 0), tried in a throw-away fork."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            code = 0
        except BaseException:  # noqa: BLE001 - the answer is the exit status
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status == 0


def _import_when_idle(names):
    """Imports `names` under SCHED_IDLE where the zygote may leave it again afterwards (its forks
    inherit its policy), so that the node's running workers and a round change keep the CPU;
    else at normal priority. Returns an error when it could not leave SCHED_IDLE, else None."""
    if not _can_leave_idle():
        _import_all(names)
        return None
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        _import_all(names)
    finally:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as e:
            return "cannot return to SCHED_OTHER after importing the program's modules: %s" % e
    return None


def _fork_spare(request, fds, name):
    """Forks a spare for `request` through a short-lived intermediate process, so that the
    agent adopts it. Returns its pid in the zygote, a _Spare in the spare."""
    report_r, report_w = os.pipe()
    _flush()
    middle = os.fork()
    if middle == 0:
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(report_r)
            os.close(report_w)
            return _Spare(request.get("env", {}), fds, name, me)
        try:
            os.setpgid(pid, pid)
            os.write(report_w, b"%d" % pid)
        finally:
            os._exit(0)
    os.close(report_w)
    try:
        data = b""
        while True:
            chunk = os.read(report_r, 64)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(report_r)
        os.waitpid(middle, 0)
        for fd in fds:
            os.close(fd)
    if not data:
        raise OSError("the intermediate process could not fork")
    return int(data)


def zygote(sock_fd):
    """Imports once, then forks a spare per request on SOCK_FD until the agent closes it.
    Returns the zygote's exit status, or, in a forked spare, its _Spare."""
    import socket
    sock = socket.socket(fileno=sock_fd)
    with open("/proc/self/comm", "rb") as f:
        name = f.read().strip()
    _prctl(_PR_SET_NAME, ZYGOTE_NAME)
    _preload(os.environ.get(Env.PRELOAD_MODULES, DEFAULT_MODULES))
    threads = _threads()
    if threads != 1:
        # fork() copies only the calling thread: a lock another thread held stays locked.
        _send(sock, error="the imports started %d threads; a zygote must have one (set "
                          "EFDL_PRELOAD_MODULES, or run with --no-zygote)" % threads)
        return 1
    # Everything imported so far lives as long as the spares forked from here: move it out of
    # the collector's generations, so that a spare's collections (and its exit) do not write to
    # every shared page just to visit it (copy-on-write would then copy them all).
    import gc
    gc.freeze()
    _send(sock, ready=True)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        except (ConnectionError, OSError):
            return 0
        if not msg:
            return 0  # the agent closed its end: nothing more to fork
        request = json.loads(msg)
        if "import" in request and not fds:
            # The program's imports, learned from its workers: import them here too, so the
            # next spares are forked with them.
            error = _import_when_idle(request["import"])
            threads = _threads()
            if threads != 1:
                error = ("importing the program's modules started %d threads; a zygote must "
                         "have one" % threads)
            elif _cuda_initialized():
                error = ("importing the program's modules initialised CUDA, which a forked "
                         "process cannot use")
            if error:
                _send(sock, error=error)
                return 1
            gc.freeze()
            _send(sock, ready=True)
            continue
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            _send(sock, error="a fork request needs 4 descriptors, got %d" % len(fds))
            continue
        try:
            pid = _fork_spare(request, fds, name)
        except Exception as e:  # noqa: BLE001 - reported to the agent, which falls back
            _send(sock, error="cannot fork a spare: %s" % e)
            continue
        if isinstance(pid, _Spare):   # this is the spare now: leave the zygote's loop
            sock.close()
            return pid
        _send(sock, pid=pid)


def _exit_status(code):
    """The status the interpreter exits with for SystemExit(code); it prints a code that is
    neither None nor an integer, as the interpreter does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:  # noqa: BLE001 - like the interpreter: the status is what matters
        pass
    return 1


def _exit_without_teardown(code):
    """Ends a worker forked from the zygote the way the interpreter's exit does - non-daemon
    threads joined, atexit hooks run (the process group's destruction among them), files the
    program left open flushed, standard streams flushed - then _exit. The rest of a normal exit
    only frees the interpreter's objects one by one, and in a process forked from the zygote
    that writes to nearly every page it shares with the zygote, which the kernel copies first:
    1.0-2.1 s at every round change for the demo's program, against 0.01 s here. The worker's
    objects are not finalized one by one: a __del__ doing more than freeing memory (other than
    a file's flush) is not run, as the interpreter itself does not promise."""
    import atexit
    import gc
    import io
    import threading
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        gc.collect()   # finalizers of unreachable objects (cycles), as the exit's collection
        for obj in gc.get_objects():
            if isinstance(obj, io.IOBase):
                try:
                    if not obj.closed and obj.writable():
                        obj.flush()
                except Exception:  # noqa: BLE001 - a broken file must not keep the process
                    pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        _report_imports_quietly()
        os._exit(code)


def _report_imports_later():
    started = time.monotonic()
    for after in _REPORT_AFTER_S:
        time.sleep(max(0.0, started + after - time.monotonic()))
        _report_imports_quietly()


def _report_imports_quietly():
    try:
        _report_imports()
    except Exception:  # noqa: BLE001 - learning is an optimisation, never a failure
        pass


def _installed(name, module, stdlib):
    """True for a module of an installed library or the standard library that a program
    imports by name: not private (no part starting with "_"), from a file under a
    site-packages/dist-packages directory or the standard library's. The program's own
    modules (next to it, on PYTHONPATH) are left out: they may change while the job runs."""
    if any(part.startswith("_") for part in name.split(".")):
        return False
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    path = os.path.realpath(path)
    return (any(part.endswith("-packages") for part in path.split(os.sep))
            or path.startswith(stdlib + os.sep))


def _report_imports():
    """Writes the installed modules the program imported, in import order, as a JSON list to
    EFDL_IMPORTS_DIR/imports-PID-N.json (atomically), for the agent to import in the zygote."""
    directory = os.environ.get(IMPORTS_DIR_ENV)
    if not directory or _modules_before_program is None:
        return
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    names = [name for name, module in list(sys.modules.items())
             if name not in _modules_before_program and _installed(name, module, stdlib)]
    if not names:
        return
    path = os.path.join(directory, "imports-%d-%d.json" % (os.getpid(), time.monotonic_ns()))
    with open(path + ".tmp", "w") as f:
        json.dump(names[:_MAX_REPORTED], f)
    os.replace(path + ".tmp", path)


def main():
    _forget_preload_path()
    if sys.argv[1] == "--zygote":
        agent = os.getppid()
        spare = zygote(int(sys.argv[2]))
        if not isinstance(spare, _Spare):
            return spare
        # A forked spare: from here on it lives exactly as a started one, and ends as the
        # interpreter's exit does, less its teardown (_exit_without_teardown).
        try:
            code = _serve(*_become_spare(spare, agent))
        except SystemExit as e:
            code = _exit_status(e.code)
        _exit_without_teardown(code)
    fd = int(sys.argv[1])
    _preload(os.environ.get(Env.PRELOAD_MODULES, DEFAULT_MODULES))
    return _serve(fd, int(sys.argv[2]) if len(sys.argv) > 2 else None)


if __name__ == "__main__":
    sys.exit(main())
