"""scripts/install-python-package.py (what `make install` runs), into a scratch directory."""

import os
import subprocess

from conftest import PYTHON, PYTHON_DIR, REPO

SCRIPT = os.path.join(REPO, "scripts", "install-python-package.py")
IMPORT_CHECK = ("import site, sys; site.addsitedir(sys.argv[1]); import efdl, efdl.data, os; "
                "print(os.path.realpath(efdl.__file__))")


def install(*args):
    return subprocess.run([PYTHON, SCRIPT] + list(args), capture_output=True, text=True,
                          timeout=120)


def imported_from(site_dir):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([PYTHON, "-c", IMPORT_CHECK, site_dir], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_copy_install_is_importable_and_replaces_a_previous_one(tmp_path):
    site_dir = str(tmp_path / "site")
    first = install(PYTHON_DIR, "--target", site_dir)
    assert first.returncode == 0, first.stderr
    (tmp_path / "site" / "efdl" / "stale.py").write_text("")
    again = install(PYTHON_DIR, "--target", site_dir)
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "site" / "efdl" / "stale.py").exists()
    assert imported_from(site_dir) == os.path.join(site_dir, "efdl", "__init__.py")
    assert not any(n.startswith(".efdl-staging") for n in os.listdir(site_dir))


def test_develop_install_points_at_the_working_tree(tmp_path):
    site_dir = str(tmp_path / "site")
    proc = install(PYTHON_DIR, "--target", site_dir, "--develop")
    assert proc.returncode == 0, proc.stderr
    assert imported_from(site_dir) == os.path.realpath(os.path.join(PYTHON_DIR, "efdl",
                                                                    "__init__.py"))


def test_bad_source_or_foreign_target_is_refused_with_one_line(tmp_path):
    proc = install(str(tmp_path), "--target", str(tmp_path / "site"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "install-python-package: %s has no efdl/__init__.py; pass the repository's python/ "
        "directory" % tmp_path]
    foreign = tmp_path / "site2" / "efdl"
    foreign.mkdir(parents=True)
    proc = install(PYTHON_DIR, "--target", str(tmp_path / "site2"))
    assert proc.returncode == 1 and "was not installed by this script" in proc.stderr
