"""scripts/install-python-package.py (what `make install` and `make uninstall` run).

Every test runs the installer with its own interpreter: a venv made in the test's tmp dir from
/usr/bin/python3 without the system site-packages, so neither the working tree (PYTHONPATH) nor
an EFDL that `make install` put in /usr/local/lib/python3.11/dist-packages is visible to it;
Debian's /usr/lib/python3/dist-packages (torch, numpy) is added by a .pth. Whether this machine
has EFDL installed therefore neither breaks nor helps these tests.
"""

import os
import subprocess

import pytest

from conftest import PYTHON, PYTHON_DIR, REPO

SCRIPT = os.path.join(REPO, "scripts", "install-python-package.py")
IMPORT_CHECK = ("import site, sys; sys.argv[1:] and site.addsitedir(sys.argv[1]); "
                "import efdl, efdl.data, os; print(os.path.realpath(efdl.__file__))")
DEBIAN_PACKAGES = "/usr/lib/python3/dist-packages"
RECORD = "efdl-install-record.txt"


class Isolated:
    """A venv's interpreter, its site-packages, and an environment without PYTHONPATH."""

    def __init__(self, root):
        subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(root)], check=True,
                       capture_output=True, timeout=120)
        self.python = str(root / "bin" / "python3")
        # Bytecode is written, as on a user's machine (uninstall must remove it too).
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE",
                                 "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
        self.site = self.query("import sysconfig; print(sysconfig.get_paths()['purelib'])")
        with open(os.path.join(self.site, "debian-dist-packages.pth"), "w") as f:
            f.write(DEBIAN_PACKAGES + "\n")
        path = self.query("import sys; print('\\n'.join(sys.path))").splitlines()
        seen = self.query("import importlib.util as u; s = u.find_spec('efdl'); "
                          "print(s.origin if s else '')")
        # The isolation itself: no other site directory, and no efdl anywhere.
        assert [p for p in path if p.endswith(("site-packages", "dist-packages"))] == [
            self.site, DEBIAN_PACKAGES], path
        assert seen == "", "the isolated interpreter still imports efdl from %s" % seen

    def query(self, code, *args):
        proc = subprocess.run([self.python, "-c", code] + list(args), env=self.env, cwd="/",
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def install(self, *args):
        return subprocess.run([self.python, SCRIPT] + list(args), env=self.env, cwd="/",
                              capture_output=True, text=True, timeout=120)

    def imported_from(self, site_dir=None):
        return self.query(IMPORT_CHECK, *([site_dir] if site_dir else []))


@pytest.fixture
def isolated(tmp_path):
    return Isolated(tmp_path / "venv")


def tree(directory):
    """Every path under `directory` (relative), directories included."""
    found = set()
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            found.add(os.path.relpath(os.path.join(root, name), directory))
    return found


def test_copy_install_is_importable_and_replaces_a_previous_one(isolated, tmp_path):
    site_dir = str(tmp_path / "site")
    first = isolated.install(PYTHON_DIR, "--target", site_dir)
    assert first.returncode == 0, first.stderr
    (tmp_path / "site" / "efdl" / "stale.py").write_text("")
    again = isolated.install(PYTHON_DIR, "--target", site_dir)
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "site" / "efdl" / "stale.py").exists()
    assert isolated.imported_from(site_dir) == os.path.join(site_dir, "efdl", "__init__.py")
    assert not any(n.startswith((".efdl-staging", ".efdl-record")) for n in os.listdir(site_dir))
    record = (tmp_path / "site" / RECORD).read_text()
    assert "file %s\n" % os.path.join(site_dir, "efdl", "__init__.py") in record
    assert "stale.py" not in record


def test_develop_install_points_at_the_working_tree_and_uninstalls(isolated, tmp_path):
    site_dir = str(tmp_path / "site")
    proc = isolated.install(PYTHON_DIR, "--target", site_dir, "--develop")
    assert proc.returncode == 0, proc.stderr
    assert isolated.imported_from(site_dir) == os.path.realpath(os.path.join(PYTHON_DIR, "efdl",
                                                                             "__init__.py"))
    proc = isolated.install("--uninstall", "--target", site_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["removed " + os.path.join(site_dir, "efdl.pth"),
                                        "removed " + os.path.join(site_dir, RECORD)]
    assert os.listdir(site_dir) == []
    assert os.path.isfile(os.path.join(PYTHON_DIR, "efdl", "__init__.py"))


def test_default_install_and_uninstall_leave_nothing_behind(isolated, tmp_path):
    # What `make install` / `make uninstall` run, in the venv's own site-packages; a file in
    # tmp stands for /usr/local/bin/efdl in cmake's install manifest.
    command = tmp_path / "bin" / "efdl"
    command.parent.mkdir()
    command.write_text("#!/bin/sh\n")
    manifest = tmp_path / "install_manifest.txt"
    manifest.write_text(str(command))
    before = tree(isolated.site)
    proc = isolated.install(PYTHON_DIR, "--cmake-manifest", str(manifest))
    assert proc.returncode == 0, proc.stderr
    installed = os.path.join(isolated.site, "efdl")
    assert "installed efdl for %s at %s" % (isolated.python, installed) in proc.stdout
    assert isolated.imported_from() == os.path.join(installed, "__init__.py")
    # Importing wrote bytecode next to the installed modules: uninstall removes it too.
    assert os.listdir(os.path.join(installed, "__pycache__"))
    with open(os.path.join(isolated.site, RECORD)) as f:
        lines = f.read().splitlines()
    assert "cmake %s" % command in lines and "dir %s" % installed in lines

    proc = isolated.install("--uninstall", "--cmake-manifest", str(manifest))
    assert proc.returncode == 0, proc.stderr
    removed = [line[len("removed "):] for line in proc.stdout.splitlines()]
    assert proc.stdout.splitlines() == ["removed " + p for p in removed]
    assert str(command) in removed and installed in removed and str(manifest) in removed
    assert os.path.join(installed, "data", "__init__.py") in removed
    assert tree(isolated.site) == before
    assert not command.exists() and not manifest.exists()
    assert isolated.query("import importlib.util as u; print(u.find_spec('efdl'))") == "None"

    again = isolated.install("--uninstall", "--cmake-manifest", str(manifest))
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.splitlines() == [
        "install-python-package: nothing to uninstall: no %s and no %s (`make install` writes "
        "them)" % (os.path.join(isolated.site, RECORD), manifest)]


def test_uninstall_keeps_what_it_did_not_install_and_says_so(isolated, tmp_path):
    site_dir = tmp_path / "site"
    proc = isolated.install(PYTHON_DIR, "--target", str(site_dir))
    assert proc.returncode == 0, proc.stderr
    (site_dir / "efdl" / "data" / "mine.txt").write_text("a user's file")
    proc = isolated.install("--uninstall", "--target", str(site_dir))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "install-python-package: kept %s: it holds what `make install` did not put there (%s); "
        "remove it by hand" % (site_dir / "efdl", site_dir / "efdl" / "data" / "mine.txt")]
    assert tree(site_dir) == {"efdl", "efdl/data", "efdl/data/mine.txt"}


def test_a_record_naming_a_path_outside_its_directory_removes_nothing(isolated, tmp_path):
    site_dir = tmp_path / "site"
    proc = isolated.install(PYTHON_DIR, "--target", str(site_dir))
    assert proc.returncode == 0, proc.stderr
    outside = tmp_path / "precious"
    outside.write_text("")
    with open(site_dir / RECORD, "a") as f:
        f.write("file %s\n" % outside)
    before = tree(site_dir)
    proc = isolated.install("--uninstall", "--target", str(site_dir))
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "not removing anything" in proc.stderr and str(outside) in proc.stderr
    assert outside.exists() and tree(site_dir) == before


def test_bad_source_or_foreign_target_is_refused_with_one_line(isolated, tmp_path):
    proc = isolated.install(str(tmp_path), "--target", str(tmp_path / "site"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "install-python-package: %s has no efdl/__init__.py; pass the repository's python/ "
        "directory" % tmp_path]
    foreign = tmp_path / "site2" / "efdl"
    foreign.mkdir(parents=True)
    proc = isolated.install(PYTHON_DIR, "--target", str(tmp_path / "site2"))
    assert proc.returncode == 1 and "was not installed by this script" in proc.stderr
    assert os.listdir(tmp_path / "site2") == ["efdl"]


def test_the_suite_imports_the_working_tree_whatever_is_installed():
    # conftest's session check, run here too so a change to it cannot silently stop checking.
    import conftest
    origins = conftest.efdl_import_origins()
    assert {os.path.realpath(p) for p in origins.values()} == {
        os.path.realpath(conftest.WORKING_TREE_EFDL)}, origins
