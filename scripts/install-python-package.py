#!/usr/bin/python3
"""Installs the `efdl` Python package for the interpreter that runs this script (`make install`
runs it with /usr/bin/python3), records what it installed, and removes it again (`make
uninstall`).

    scripts/install-python-package.py PYTHON_DIR [--target DIR] [--develop] [--cmake-manifest F]
    scripts/install-python-package.py --uninstall [--target DIR] [--cmake-manifest F]

PYTHON_DIR is the repository's python/ directory. The package, with the built extension
(_efdl*.so) when present, is copied into the interpreter's site-packages
(/usr/local/lib/python3.11/dist-packages on Debian) or --target; a previous install there is
replaced whole (staged next to it, then swapped by rename). --develop writes an efdl.pth that
points at PYTHON_DIR instead, so the working tree is imported directly. Afterwards a fresh
interpreter must import efdl from the installed place, or the script fails.

Every install writes efdl-install-record.txt in that directory: each file and directory it
created, and the files listed in --cmake-manifest (cmake's install_manifest.txt: what `cmake
--install` put on the machine, /usr/local/bin/efdl). --uninstall removes exactly what the record
(and --cmake-manifest, when it exists) lists, with the bytecode Python wrote for the recorded
modules, prints each path it removed, then deletes the record and the manifest. With neither it
refuses in one line.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

MARKER = ".efdl-install"  # marks a directory this script created, so it may replace it
RECORD = "efdl-install-record.txt"  # in the install directory: what --uninstall removes
RECORD_HEADER = ("# efdl install record, written by scripts/install-python-package.py (`make "
                 "install`); `make uninstall` removes every path listed. Kinds: dir and file (the "
                 "package, under this directory), cmake (from cmake's install manifest).\n")


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
    entries = []
    for root, dirs, files in os.walk(destination):
        dirs.sort()
        entries.append(("dir", root))
        entries += [("file", os.path.join(root, name)) for name in sorted(files)]
    return destination, entries


def install_develop(python_dir, target):
    destination = os.path.join(target, "efdl")
    if os.path.exists(os.path.join(destination, MARKER)):
        shutil.rmtree(destination)  # a copied install would shadow the working tree
    pth = os.path.join(target, "efdl.pth")
    with open(pth, "w") as f:
        f.write(os.path.abspath(python_dir) + "\n")
    return os.path.join(os.path.abspath(python_dir), "efdl"), [("file", pth)]


def read_cmake_manifest(path):
    """The absolute paths cmake's install_manifest.txt lists ([] when there is none)."""
    if not path or not os.path.isfile(path):
        return []
    with open(path) as f:
        paths = [line.strip() for line in f if line.strip()]
    bad = [p for p in paths if not os.path.isabs(p)]
    if bad:
        fail("%s lists %r, not an absolute path; not removing anything" % (path, bad[0]))
    return paths


def write_record(target, entries, cmake_paths):
    """Replaces target/RECORD (written aside, then renamed) with `entries` and `cmake_paths`."""
    record = os.path.join(target, RECORD)
    lines = ["%s %s\n" % (kind, path) for kind, path in entries]
    lines += ["cmake %s\n" % path for path in cmake_paths]
    fd, staged = tempfile.mkstemp(prefix=".efdl-record-", dir=target)
    with os.fdopen(fd, "w") as f:
        f.write(RECORD_HEADER)
        f.writelines(lines)
    os.chmod(staged, 0o644)
    os.rename(staged, record)
    return record


def read_record(target):
    """(kind, path) of each line of target/RECORD; None when there is no record."""
    record = os.path.join(target, RECORD)
    if not os.path.isfile(record):
        return None
    entries = []
    with open(record) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            kind, _, path = line.partition(" ")
            inside = os.path.isabs(path) and os.path.commonpath(
                [os.path.normpath(path), target]) == target and os.path.normpath(path) != target
            if kind not in ("dir", "file", "cmake") or not os.path.isabs(path) or (
                    kind != "cmake" and not inside):
                fail("%s line %d is not `dir|file PATH-under-%s` or `cmake PATH`: %r; not "
                     "removing anything" % (record, number, target, line))
            entries.append((kind, path))
    return entries


def remove_file(path, removed):
    if os.path.lexists(path):
        os.remove(path)
        removed.append(path)


def uninstall(target, cmake_manifest):
    target = os.path.normpath(os.path.abspath(target))
    entries = read_record(target)
    cmake_paths = read_cmake_manifest(cmake_manifest)
    if entries is None and not cmake_paths:
        hint = ""
        if os.path.exists(os.path.join(target, "efdl", MARKER)):
            hint = ("; %s was installed before installs were recorded: run `make install` again, "
                    "then `make uninstall`" % os.path.join(target, "efdl"))
        fail("nothing to uninstall: no %s%s (`make install` writes them)%s"
             % (os.path.join(target, RECORD),
                " and no " + cmake_manifest if cmake_manifest else "", hint))
    entries = entries or []
    removed, kept = [], []
    for path in sorted(set([p for k, p in entries if k == "cmake"] + cmake_paths)):
        remove_file(path, removed)
    for kind, path in entries:
        if kind != "file":
            continue
        remove_file(path, removed)
        if path.endswith(".py"):  # the bytecode Python wrote for a recorded module
            stem = os.path.splitext(os.path.basename(path))[0]
            for pyc in sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(path)),
                                                     "__pycache__", stem + ".*.pyc"))):
                remove_file(pyc, removed)
    dirs = sorted((p for k, p in entries if k == "dir"), key=lambda p: p.count(os.sep),
                  reverse=True)
    for path in dirs:
        for directory in (os.path.join(path, "__pycache__"), path):
            if not os.path.isdir(directory) or os.path.islink(directory):
                continue
            if os.listdir(directory):
                if directory == path:
                    kept.append(directory)
                continue
            os.rmdir(directory)
            removed.append(directory)
    remove_file(os.path.join(target, RECORD), removed)
    if cmake_manifest:
        remove_file(cmake_manifest, removed)
    for path in removed:
        print("removed " + path)
    if kept:
        top = [d for d in kept if not any(d.startswith(k + os.sep) for k in kept)]
        foreign = sorted(os.path.join(root, name) for d in top for root, _, files in os.walk(d)
                         for name in files)
        fail("kept %s: it holds what `make install` did not put there (%s); remove it by hand"
             % (", ".join(top), ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")))


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
    parser.add_argument("python_dir", nargs="?", help="the repository's python/ directory")
    parser.add_argument("--target", help="install into this directory instead of site-packages")
    parser.add_argument("--develop", action="store_true",
                        help="point the interpreter at python_dir (an efdl.pth) instead of copying")
    parser.add_argument("--cmake-manifest", metavar="FILE",
                        help="cmake's install_manifest.txt: record (install) or remove "
                             "(--uninstall) the files it lists too")
    parser.add_argument("--uninstall", action="store_true",
                        help="remove what the install record (and --cmake-manifest) lists")
    args = parser.parse_args()

    target = args.target or sysconfig.get_paths()["purelib"]
    if args.uninstall:
        if args.python_dir or args.develop:
            fail("--uninstall takes no PYTHON_DIR and no --develop; run it as "
                 "`install-python-package.py --uninstall [--target DIR] [--cmake-manifest F]`")
        try:
            uninstall(target, args.cmake_manifest)
        except PermissionError as e:
            fail("cannot remove %s (%s): run as root" % (e.filename, e.strerror))
        return
    if not args.python_dir:
        fail("pass the repository's python/ directory (or --uninstall)")
    source_pkg = os.path.join(args.python_dir, "efdl")
    if not os.path.isfile(os.path.join(source_pkg, "__init__.py")):
        fail("%s has no efdl/__init__.py; pass the repository's python/ directory" %
             args.python_dir)
    cmake_paths = read_cmake_manifest(args.cmake_manifest)
    try:
        os.makedirs(target, exist_ok=True)
        if args.develop:
            installed, entries = install_develop(args.python_dir, target)
        else:
            installed, entries = install_copy(source_pkg, target)
        record = write_record(target, entries, cmake_paths)
    except PermissionError as e:
        fail("cannot write to %s (%s): run as root, or pass --target DIR" % (target, e.strerror))
    found = check_import(target, installed, args.target is not None)
    extension = [n for n in os.listdir(found) if n.startswith("_efdl") and n.endswith(".so")]
    print("installed efdl for %s at %s%s" % (sys.executable, found,
                                             "" if extension else " (without the _efdl extension: "
                                             "build it first for State)"))
    print("recorded in %s (`make uninstall` removes what it lists)" % record)


if __name__ == "__main__":
    main()
