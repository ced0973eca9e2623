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
"""

import builtins
import importlib
import importlib.machinery
import json
import os
import sys
import types

DEFAULT_MODULES = "torch,torch.distributed,efdl.backend.torch"


def _preload(names):
    for name in filter(None, (n.strip() for n in names.split(","))):
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


def main():
    fd = int(sys.argv[1])
    _preload(os.environ.get("EFDL_PRELOAD_MODULES", DEFAULT_MODULES))
    if len(sys.argv) > 2:
        ready = int(sys.argv[2])
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


if __name__ == "__main__":
    sys.exit(main())
