"""A snapshot records the program that wrote it: another program that shares the job id is not
restored into silently (issue #22), unless asked with EFDL_RESTORE_OTHER_PROGRAM=1."""

import os
import subprocess
import textwrap

from conftest import PYTHON, clean_environment
from test_state import job  # noqa: F401 (fixture)

TIMEOUT = 120

PROGRAM = textwrap.dedent("""
    import sys
    import torch
    from efdl.state import State, SnapshotError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    try:
        state = State(model, step=0)
    except SnapshotError as e:
        print("REFUSED", e)
        sys.exit(4)
    print("RESTORED", state.step)
    state.step += 5
    state.commit()
    state.flush()
""")


def run(tmp_path, job, name, extra_env=None):
    path = tmp_path / name
    path.write_text(PROGRAM)
    env = dict(clean_environment(), EFDL_JOB_ID=job["EFDL_JOB_ID"], **(extra_env or {}))
    if not extra_env:
        env.pop("EFDL_RESTORE_OTHER_PROGRAM", None)   # the job fixture allows it for its readers
    return subprocess.run([PYTHON, str(path)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_a_different_program_under_the_same_job_id_is_refused_unless_asked(job, tmp_path):
    first = run(tmp_path, job, "train_a.py")
    assert first.returncode == 0 and "RESTORED 0" in first.stdout, first.stderr
    again = run(tmp_path, job, "train_a.py")   # the same program resumes
    assert again.returncode == 0 and "RESTORED 5" in again.stdout, again.stderr

    other = run(tmp_path, job, "train_b.py")
    assert other.returncode == 4, (other.stdout, other.stderr)
    line = other.stdout.strip()
    for words in ("written by the program 'train_a.py'", "(step 10)", "'train_b.py'",
                  "two programs share the job id", "--job", "efdl reset --job",
                  "EFDL_RESTORE_OTHER_PROGRAM=1"):
        assert words in line, line
    # Nothing was lost: the writer still resumes where it was.
    assert "RESTORED 10" in run(tmp_path, job, "train_a.py").stdout

    asked = run(tmp_path, job, "train_b.py", {"EFDL_RESTORE_OTHER_PROGRAM": "1"})
    assert asked.returncode == 0 and "RESTORED 15" in asked.stdout, asked.stderr
    # The snapshot it wrote is now train_b.py's.
    assert run(tmp_path, job, "train_a.py").returncode == 4
