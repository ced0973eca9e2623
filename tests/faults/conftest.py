"""Fixtures shared by the fault suite's files."""

import pytest

import faultlib
import hosts

# After the session: the tests' `ip netns add` left no mount of /run/netns behind.
no_netns_mount_left = pytest.fixture(scope="session", autouse=True)(hosts.netns_mount_check())


@pytest.fixture
def make_job():
    """make_job(name, **Job kwargs): a faultlib.Job with its etcd started; closed after the
    test (agents stopped, etcd stopped, its directories removed)."""
    jobs = []

    def make(name, **kwargs):
        job = faultlib.Job(name, **kwargs)
        jobs.append(job)
        job.start_etcd()
        return job

    yield make
    for job in jobs:
        job.close()
