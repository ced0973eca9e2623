"""Fixtures shared by the fault suite's files."""

import pytest

import faultlib
import hosts

# Whether /run/netns was a mount point before this session ran anything (see
# tests/python/conftest.py).
_NETNS_MOUNTED_AT_START = hosts.is_mount_point(hosts.NETNS_DIR)


@pytest.fixture(scope="session", autouse=True)
def no_netns_mount_left():
    """After the session: the tests' `ip netns add` left no mount of /run/netns behind."""
    yield
    hosts.check_netns_mount(_NETNS_MOUNTED_AT_START)


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
