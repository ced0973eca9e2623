"""efdl.State with EFDL_SNAPSHOT_HMAC=1: stored snapshots carry an HMAC keyed with the job's
secret (EFDL_JOB_SECRET); a job restores its own, and skips one written with another job's
secret (like a damaged file) in favour of its own older one."""

import os
import shutil

import pytest
import torch

from efdl.state import State

from test_state import (job, make_training, restore_from_storage_warned, storage_files,  # noqa: F401
                        train_step)

SECRET_A = "a" * 64
SECRET_B = "b" * 64


@pytest.fixture
def hmac_job(job, monkeypatch):  # noqa: F811
    monkeypatch.setenv("EFDL_SNAPSHOT_HMAC", "1")
    monkeypatch.setenv("EFDL_JOB_SECRET", SECRET_A)
    return job


def commit_steps(steps, seed=0):
    model, optimizer, _ = make_training(seed=seed)
    state = State(model, optimizer, step=0)
    weights = {}
    for step in steps:
        train_step(model, optimizer)
        state.step = step
        state.commit()
        state.flush()
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def test_own_snapshot_restores_and_another_jobs_is_skipped(hmac_job, monkeypatch, tmp_path):
    weights = commit_steps([1])
    ours = storage_files(hmac_job)
    assert len(ours) == 1
    with open(ours[0], "rb") as f:
        assert b'"hmac":"' in f.read(4096)

    # Another job (another secret) writes step 2 elsewhere; the file is planted in our dir.
    other_dir = tmp_path / "other"
    monkeypatch.setenv("EFDL_JOB_SECRET", SECRET_B)
    monkeypatch.setenv("EFDL_SNAPSHOT_DIR", str(other_dir))
    commit_steps([1, 2], seed=5)
    planted = sorted((other_dir / hmac_job["EFDL_JOB_ID"]).glob("snap-*"))[-1]
    shutil.copy(planted, os.path.dirname(ours[0]))

    monkeypatch.setenv("EFDL_JOB_SECRET", SECRET_A)
    monkeypatch.setenv("EFDL_SNAPSHOT_DIR", hmac_job["EFDL_SNAPSHOT_DIR"])
    restored, model = restore_from_storage_warned(hmac_job, "failed its HMAC check")
    assert restored.step == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[1][k]), k


def test_hmac_without_a_secret_is_a_clear_error(hmac_job, monkeypatch):
    monkeypatch.delenv("EFDL_JOB_SECRET")
    model, optimizer, _ = make_training()
    with pytest.raises(ValueError, match="EFDL_SNAPSHOT_HMAC=1 needs the job's secret"):
        State(model, optimizer, step=0)
