"""A normal exit leaves the newest commit in storage, also when the State was a local of a
function that returned first (found by the fault suite: the job's final snapshot was missing)."""

import json
import os
import subprocess

import faultlib

PROGRAM = r"""
import torch
from efdl.state import State
def main():
    model = torch.nn.Linear(4, 2)
    state = State(model, step=0)
    state.set_commit_interval(1)
    for state.step in range(1, 8):
        state.commit()
main()
"""


def test_final_commit_of_a_state_local_to_main_reaches_storage(tmp_path):
    env = faultlib.cluster.base_env()
    env.update(EFDL_JOB_ID="exit-%d" % os.getpid(), EFDL_SNAPSHOT_DIR=str(tmp_path / "snap"),
               EFDL_SHM_DIR=str(tmp_path), EFDL_PERSIST_MIN_INTERVAL_MS="60000")
    proc = subprocess.run([faultlib.PYTHON, "-c", PROGRAM], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if faultlib.efdl_bin() is None:
        files = os.listdir(tmp_path / "snap" / env["EFDL_JOB_ID"])
        assert any(f.startswith("snap-") for f in files), files
        return
    out = subprocess.run([faultlib.efdl_bin(), "snapshots", "list", "--json", "--job",
                          env["EFDL_JOB_ID"], "--snapshot-dir", str(tmp_path / "snap")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    steps = [r["step"] for r in json.loads(out.stdout) if r["ok"]]
    assert max(steps) == 7, steps
