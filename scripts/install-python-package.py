#!/usr/bin/python3
"""Installs the `efdl` Python package for the interpreter that runs this script (`make install`
runs it with /usr/bin/python3).

    scripts/install-python-package.py PYTHON_DIR [--target DIR] [--develop]

PYTHON_DIR is the repository's python/ directory. The package, with the built extension
(_efdl*.so) when present, is copied into the interpreter's site-packages
(/usr/local/lib/python3.11/dist-packages on Debian) or --target; a previous install there is
replaced whole (staged next to it, then swapped by rename). --develop writes an efdl.pth that
points at PYTHON_DIR instead, so the working tree is imported directly. Afterwards a fresh
interpreter must import efdl from the installed place, or the script fails.
"""

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

MARKER = ".efdl-install"  # marks a directory this script created, so it may replace it


def fail(message):
    print("install-python-package: " + message, file=sys.stderr)
    sys.exit(1)


def ignore_build_leftovers(directory, names):
    return [n for n in names if n == "__pycache__" or n.endswith((".pyc", ".pyo"))]


def install_copy(source_pkg, target):
    destination = os.path.join(target, "efdl")
    if os.path.exists(destination) and not os.path.exists(os.path.join(destination, MARKER)):
        fail("%s exists and was not installed by this script; remove it first" % destination)
    staging = tempfile.mkdtemp(prefix=".efdl-staging-", dir=target)
    try:
        staged = os.path.join(staging, "efdl")
        shutil.copytree(source_pkg, staged, ignore=ignore_build_leftovers)
        with open(os.path.join(staged, MARKER), "w") as f:
            f.write("installed from %s\n" % os.path.abspath(source_pkg))
        old = os.path.join(staging, "old")
        if os.path.exists(destination):
            os.rename(destination, old)
        os.rename(staged, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    pth = os.path.join(target, "efdl.pth")
    if os.path.exists(pth):
        os.remove(pth)  # a previous --develop install would shadow the copy
    return destination


def install_develop(python_dir, target):
    destination = os.path.join(target, "efdl")
    if os.path.exists(os.path.join(destination, MARKER)):
        shutil.rmtree(destination)  # a copied install would shadow the working tree
    pth = os.path.join(target, "efdl.pth")
    with open(pth, "w") as f:
        f.write(os.path.abspath(python_dir) + "\n")
    return os.path.join(os.path.abspath(python_dir), "efdl")


def check_import(target, expected, explicit_target):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # A directory outside site-packages is only seen when added as a site dir (.pth included).
    prelude = "import site; site.addsitedir(%r); " % target if explicit_target else ""
    proc = subprocess.run([sys.executable, "-c", prelude + "import efdl, os; print(os.path."
                           "dirname(os.path.realpath(efdl.__file__)))"], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        fail("the installed package does not import: " + proc.stderr.strip().splitlines()[-1])
    found = proc.stdout.strip()
    if found != os.path.realpath(expected):
        fail("a fresh interpreter imports efdl from %s, not from %s; remove the other copy"
             % (found, expected))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("python_dir", help="the repository's python/ directory")
    parser.add_argument("--target", help="install into this directory instead of site-packages")
    parser.add_argument("--develop", action="store_true",
                        help="point the interpreter at python_dir (an efdl.pth) instead of copying")
    args = parser.parse_args()

    source_pkg = os.path.join(args.python_dir, "efdl")
    if not os.path.isfile(os.path.join(source_pkg, "__init__.py")):
        fail("%s has no efdl/__init__.py; pass the repository's python/ directory" %
             args.python_dir)
    target = args.target or sysconfig.get_paths()["purelib"]
    try:
        os.makedirs(target, exist_ok=True)
        if args.develop:
            installed = install_develop(args.python_dir, target)
        else:
            installed = install_copy(source_pkg, target)
    except PermissionError as e:
        fail("cannot write to %s (%s): run as root, or pass --target DIR" % (target, e.strerror))
    found = check_import(target, installed, args.target is not None)
    extension = [n for n in os.listdir(found) if n.startswith("_efdl") and n.endswith(".so")]
    print("installed efdl for %s at %s%s" % (sys.executable, found,
                                             "" if extension else " (without the _efdl extension: "
                                             "build it first for State)"))


if __name__ == "__main__":
    main()
