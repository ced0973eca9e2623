"""The multi-host test world (tests/python/workers/hosts.py) does what the e2e and fault tests rely
on: names, /etc/hosts, private /dev/shm and /tmp, traffic between hosts and to the bridge, a
whole-host SIGKILL (also of processes that left their session), restarts with and without the
old /dev/shm, a cut link, directories of this machine's /tmp the hosts must see (a checkout in
/tmp), and nothing left behind."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))

import hosts  # noqa: E402
import cluster  # noqa: E402
from cluster import PYTHON  # noqa: E402

_why = hosts.HostWorld.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))

SERVE = ("import socket, sys\n"
         "s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen()\n"
         "print('listening', flush=True)\n"
         "c, a = s.accept(); print(a[0], flush=True)\n")
CONNECT = ("import socket, sys\n"
           "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
           "print(s.getsockname()[0])\n")


def test_hosts_look_like_separate_debian_machines():
    with hosts.HostWorld(2) as w:
        h1, h2 = w.hosts
        # Names through getaddrinfo (`getent ahosts`: what programs use), not `getent hosts`,
        # whose IPv6 query first asks the hosts' unreachable DNS server (10 s per name).
        out = h1.run(["sh", "-c", "hostname; getent ahosts $(hostname) | head -n 1; "
                      "getent ahosts %s | head -n 1; getent hosts localhost" % h2.name])
        lines = out.stdout.split("\n")
        assert lines[0] == h1.name, out
        assert lines[1].split() == ["127.0.1.1", "STREAM", h1.name], out
        assert lines[2].split() == [h2.addr, "STREAM", h2.name], out
        assert "127.0.0.1" in lines[3] or "::1" in lines[3], out
        # Own /dev/shm and /tmp: a file made in one host is not in the other, nor outside. (Its
        # /tmp holds only what must be visible: the checkout when that is under /tmp.)
        assert h1.run(["sh", "-c", "echo one > /dev/shm/efdl-probe && echo t > /tmp/probe"]
                      ).returncode == 0
        visible = sorted({os.path.relpath(p, "/tmp").split("/")[0] for p in w.visible})
        assert h2.run(["ls", "/dev/shm"]).stdout.split() == []
        assert h2.run(["ls", "/tmp"]).stdout.split() == visible
        assert not os.path.exists("/dev/shm/efdl-probe")
        assert os.path.exists(os.path.join(h1.shm_dir, "efdl-probe"))
        # Traffic from host to host by name, and to the bridge side.
        srv = h2.popen([PYTHON, "-c", SERVE, "4567"], stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "listening"
            c = h1.run([PYTHON, "-c", CONNECT, h2.name, "4567"])
            assert c.stdout.strip() == h1.addr, c
            assert srv.stdout.readline().strip() == h1.addr
        finally:
            srv.kill()
            srv.wait(10)
        with socket.socket() as s:
            s.bind((w.bridge_addr, 0))
            s.listen()
            port = s.getsockname()[1]
            c = h1.run([PYTHON, "-c", CONNECT, w.bridge_addr, str(port)])
            assert c.stdout.strip() == h1.addr, c
    assert w.leftovers() == []


def test_kill_restart_and_link_cut():
    with hosts.HostWorld(2) as w:
        h1, h2 = w.hosts
        # A process that left the host's session and process group still dies with the host.
        p = h1.popen(["sh", "-c", "setsid sleep 600 & sleep 600"])
        cluster.poll_until(lambda: len(h1.pids()) >= 3, 10)
        victims = h1.pids()
        assert len(victims) >= 3, victims
        h1.run(["sh", "-c", "echo kept > /dev/shm/arena"])
        h1.kill()
        assert p.wait(10) != 0
        assert h1.pids() == []
        for pid in victims:
            assert not os.path.exists("/proc/%d" % pid) or \
                open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0] == "Z"
        # Restarted as the same machine: same name and /dev/shm contents.
        h1.start()
        assert h1.run(["hostname"]).stdout.strip() == h1.name
        assert h1.run(["cat", "/dev/shm/arena"]).stdout.strip() == "kept"
        # A replaced machine: an empty /dev/shm.
        h1.restart(empty_shm=True)
        assert h1.run(["ls", "/dev/shm"]).stdout.strip() == ""
        # Cut off: nothing reaches the other host; back up: it does again.
        srv = h2.popen([PYTHON, "-c", SERVE, "4568"], stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "listening"
            h1.link_down()
            assert h1.run([PYTHON, "-c", CONNECT, h2.addr, "4568"]).returncode != 0
            h1.link_up()
            tries = []

            def connected():
                tries.append(h1.run([PYTHON, "-c", CONNECT, h2.addr, "4568"]))
                return tries[-1].returncode == 0
            cluster.poll_until(connected, 10, 0.2)
            c = tries[-1]
            assert c.stdout.strip() == h1.addr, c
        finally:
            srv.kill()
            srv.wait(10)
    assert w.leftovers() == []


def test_directories_under_tmp_are_seen_at_their_path():
    """Each host has its own /tmp, so a checkout in /tmp (the program, efdl, the python path)
    would be missing there: the world binds such directories in at the same path."""
    outside = tempfile.mkdtemp(prefix="efdl-visible-", dir="/tmp")
    try:
        with open(os.path.join(outside, "program"), "w") as f:
            f.write("here\n")
        with hosts.HostWorld(2, visible=[outside, os.path.join(outside, "nested"), "/var/tmp"]) \
                as w:
            assert w.visible == [outside]   # nested in it, or not under /tmp: nothing to do
            h1, h2 = w.hosts
            assert h1.run(["cat", os.path.join(outside, "program")]).stdout == "here\n"
            # The same directory: what a host writes there is seen outside and on the other.
            assert h2.run(["sh", "-c", "echo h2 > %s/out" % outside]).returncode == 0
            with open(os.path.join(outside, "out")) as f:
                assert f.read() == "h2\n"
            assert h1.run(["ls", "/tmp"]).stdout.split() == [os.path.basename(outside)]
            # Working in it, as a host's processes do when the checkout is their cwd.
            p = h1.popen(["pwd"], cwd=outside, stdout=subprocess.PIPE, text=True)
            assert p.communicate(timeout=10)[0].strip() == outside
            # Still there after a restart.
            h1.restart()
            assert h1.run(["cat", os.path.join(outside, "program")]).stdout == "here\n"
        assert w.leftovers() == []
        # Removing the world's directories never reached into the bound one.
        assert sorted(os.listdir(outside)) == ["out", "program"]
    finally:
        shutil.rmtree(outside, ignore_errors=True)
