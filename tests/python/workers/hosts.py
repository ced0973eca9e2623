"""Several "hosts" on this one machine, for tests that need real hosts' differences.

HostWorld(n) makes n hosts. Each host has
  - its own network namespace, joined to a Linux bridge in the root namespace by a veth pair
    ("eth0" inside, 10.R.S.(10+i)/24 in a test-only subnet; the bridge is 10.R.S.1, where etcd
    or anything else in the root namespace can listen),
  - its own UTS namespace with its own host name (efdl-<tag>-h<i>),
  - an /etc/hosts like a fresh Debian install: localhost lines, its own name -> 127.0.1.1, the
    other hosts' names -> their bridge addresses,
  - its own /dev/shm (a tmpfs mounted, in the root namespace, at <world dir>/h<i>/shm and bind
    mounted over /dev/shm) and /tmp (<world dir>/h<i>/tmp), in its own mount namespace,
  - its own PID namespace, whose init (PID 1) is a `sleep` that the host's processes are
    entered under (nsenter): kill() SIGKILLs that init, and the kernel kills every process of
    the host with it, whatever they did (new sessions, double forks).

A host can be kill()ed as a whole, start()ed again (same name, address and /dev/shm contents:
a process or container restart; start(empty_shm=True): a replaced machine), and cut off
(link_down() / link_up(): the root side of its veth). Everything the world made (processes,
namespaces, links, the bridge, mounts, directories) is removed by close(), also after a failed
setup; kill only ever targets pids this module started. That includes the mount of /run/netns
that the first `ip netns add` on a machine makes (and `ip netns delete` never undoes): a world
that found /run/netns unmounted before its first namespace unmounts it again at close(), when no
namespace is left in it (NetnsMount).

The world's directory is under /var/tmp, not /tmp (each host has its own /tmp): its `shared`
subdirectory is visible to every host under the same path (like a shared file system). What the
hosts run must be visible to them too: the repository checkout, EFDL_BIN's directory, the
PYTHONPATH entries and the working directory that do live under /tmp (a clone in /tmp/x) are
bind mounted, in each host's own mount namespace, at the same path inside its /tmp
(HostWorld(visible=...) names others).

Needs root, `ip`, `unshare`, `nsenter` and `mount`; HostWorld.unavailable() says in one line why
a world cannot be made here (tests skip with it).
"""

import os
import shlex
import shutil
import signal
import subprocess
import tempfile

import cluster

_TOOLS = ("ip", "unshare", "nsenter", "mount", "umount", "sleep")

# The repository this file belongs to (tests/python/workers/hosts.py).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))


def _under_tmp(paths):
    """The real paths of `paths` that lie below /tmp, without those inside another of them."""
    found = set()
    for p in paths:
        if not p:
            continue
        real = os.path.realpath(p)
        if real.startswith("/tmp/") and os.path.isdir(real):
            found.add(real)
    return sorted(p for p in found
                  if not any(p != q and p.startswith(q + "/") for q in found))


def _default_visible():
    """What a host must see of this machine's /tmp: the checkout, EFDL_BIN's directory, the
    PYTHONPATH entries and the working directory, where they live under /tmp."""
    paths = [_REPO, os.getcwd()]
    if os.environ.get("EFDL_BIN"):
        paths.append(os.path.dirname(os.path.realpath(os.environ["EFDL_BIN"])))
    paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return paths


def _run(argv, check=True):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(argv), (proc.stderr or proc.stdout).strip()))
    return proc


NETNS_DIR = "/run/netns"


def is_mount_point(path):
    """True when `path` is a mount point in this mount namespace (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        return any(len(fields) > 4 and fields[4] == path
                   for fields in (line.split() for line in f))


def _netns_names():
    return _run(["ip", "netns", "list"], check=False).stdout.split()


class NetnsMount:
    """`ip netns add` makes /run/netns a mount point the first time (a bind mount of itself, so
    that each namespace's own bind mount in it propagates) and `ip netns delete` never unmounts
    it. An owner adds its namespaces through add(), which remembers whether /run/netns was a
    mount point before the first one; release() unmounts it when this owner made the mount and
    `ip netns list` is empty, and never one that was there before or still holds namespaces
    (another user's)."""

    def __init__(self):
        self.made = None          # None: nothing added yet; else whether our add mounted it

    def add(self, name):
        if self.made is None:
            self.made = not is_mount_point(NETNS_DIR)
        return _run(["ip", "netns", "add", name], check=False)

    def leftover(self):
        """True when this owner made the mount, it is still there and holds no namespace."""
        return bool(self.made) and is_mount_point(NETNS_DIR) and not _netns_names()

    def release(self):
        if self.leftover():
            _run(["umount", NETNS_DIR], check=False)


def netns_mount_check():
    """A test session's leftover check, as the body of a session-scoped autouse fixture (made
    when a conftest is imported, before the test modules, whose HostWorld.unavailable() probes
    make a namespace): after the session, fails when /run/netns was no mount point before, is
    one now and holds no namespace (some `ip netns add` of the session left its mount behind:
    an owner that did not release() its NetnsMount)."""
    mounted_before = is_mount_point(NETNS_DIR)

    def check():
        yield
        if not mounted_before and is_mount_point(NETNS_DIR) and not _netns_names():
            raise AssertionError("%s is left mounted (it was not before the tests, and no "
                                 "network namespace is in it): run `umount %s`; the tests' "
                                 "`ip netns add` must go through hosts.NetnsMount"
                                 % (NETNS_DIR, NETNS_DIR))
    return check


def _children(pid):
    """Pids of `pid`'s children (all its threads')."""
    out = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def _wait_gone(pid, timeout):
    """Waits until /proc/<pid> is gone (or a zombie); True when it is."""
    return cluster.poll_until(lambda: not cluster.alive(pid), timeout, 0.02) is True


class Host:
    """One host of a HostWorld; see the module's docstring."""

    def __init__(self, world, index):
        self.world = world
        self.index = index
        self.name = "efdl-%s-h%d" % (world.tag, index)            # host name (UTS)
        self.netns = "efdl-%s-h%d" % (world.tag, index)
        self.veth = "efv%sh%d" % (world.tag, index)               # root-namespace side
        self.iface = "eth0"                                       # the host's side
        self.addr = "%s.%d" % (world.prefix, 10 + index)
        self.dir = os.path.join(world.dir, "h%d" % index)
        self.shm_dir = os.path.join(self.dir, "shm")              # its /dev/shm, seen from outside
        self.tmp_dir = os.path.join(self.dir, "tmp")              # its /tmp, seen from outside
        self.hosts_file = os.path.join(self.dir, "hosts")
        self._unshare = None      # Popen of `ip netns exec NS unshare ... sleep`
        self.init_pid = None      # the PID namespace's init, seen from the root namespace
        self._shm_mounted = False
        self._netns_made = False
        self._veth_made = False

    # -- setup ------------------------------------------------------------------------------

    def _make_network(self):
        w = self.world
        added = w.netns_mount.add(self.netns)
        if added.returncode != 0:
            raise RuntimeError("ip netns add %s: %s" % (self.netns, added.stderr.strip()))
        self._netns_made = True
        _run(["ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.iface,
              "netns", self.netns])
        self._veth_made = True
        _run(["ip", "link", "set", self.veth, "master", w.bridge])
        _run(["ip", "link", "set", self.veth, "up"])
        inside = ["ip", "netns", "exec", self.netns]
        _run(inside + ["ip", "addr", "add", "%s/24" % self.addr, "dev", self.iface])
        _run(inside + ["ip", "link", "set", self.iface, "up"])
        _run(inside + ["ip", "link", "set", "lo", "up"])
        _run(inside + ["ip", "route", "add", "default", "via", w.bridge_addr])

    def _write_hosts_file(self):
        lines = ["127.0.0.1\tlocalhost", "127.0.1.1\t%s" % self.name]
        for other in self.world.hosts:
            if other is not self:
                lines.append("%s\t%s" % (other.addr, other.name))
        lines += ["", "# The following lines are desirable for IPv6 capable hosts",
                  "::1     localhost ip6-localhost ip6-loopback",
                  "ff02::1 ip6-allnodes", "ff02::2 ip6-allrouters", ""]
        with open(self.hosts_file, "w") as f:
            f.write("\n".join(lines))

    def _mount_shm(self):
        os.makedirs(self.shm_dir, exist_ok=True)
        _run(["mount", "-t", "tmpfs", "-o", "size=%dm,mode=1777" % self.world.shm_mb,
              "efdl-test-shm", self.shm_dir])
        self._shm_mounted = True

    def resize_shm(self, size):
        """Sets the size of the host's /dev/shm (tmpfs `size=`: bytes, or with k/m/g), contents
        kept: a host with little shared memory (it must still hold what is in it). The next
        start(empty_shm=True) mounts the world's size again."""
        _run(["mount", "-o", "remount,size=%s" % size, self.shm_dir])

    def _unmount_shm(self):
        if self._shm_mounted:
            if _run(["umount", self.shm_dir], check=False).returncode != 0:
                _run(["umount", "-l", self.shm_dir], check=False)
            self._shm_mounted = False

    # -- life cycle -------------------------------------------------------------------------

    def start(self, empty_shm=False, timeout=20):
        """Boots the host: a new PID, mount and UTS namespace in its network namespace, with its
        name, /etc/hosts, /dev/shm and /tmp. empty_shm: a fresh /dev/shm (a replaced machine);
        otherwise the contents of the last one (a restart)."""
        if self.running():
            raise RuntimeError("host %s is already running" % self.name)
        if empty_shm or not self._shm_mounted:
            self._unmount_shm()
            self._mount_shm()
        os.makedirs(self.tmp_dir, exist_ok=True)
        os.chmod(self.tmp_dir, 0o1777)
        # This machine's directories under /tmp that the host must see, bound (in the host's
        # mount namespace only) onto the same path inside its /tmp before that covers /tmp;
        # --rbind takes them along.
        binds = []
        for path in self.world.visible:
            inside = os.path.join(self.tmp_dir, os.path.relpath(path, "/tmp"))
            os.makedirs(inside, exist_ok=True)
            binds.append("mount --bind %s %s" % (shlex.quote(path), shlex.quote(inside)))
        q = shlex.quote
        script = " && ".join([
            "hostname %s" % q(self.name),
            "mount --bind %s /etc/hosts" % q(self.hosts_file),
            "mount --bind %s /dev/shm" % q(self.shm_dir)] + binds + [
            "mount --rbind %s /tmp" % q(self.tmp_dir),
            "exec sleep infinity"])
        # unshare forks the namespace's init (PID 1) and waits for it; --kill-child: if the
        # unshare process dies, so does the init, and with it the whole host.
        self._unshare = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--mount",
             "--uts", "--mount-proc", "--propagation", "private", "--kill-child",
             "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        def booted():
            if self._unshare.poll() is not None:
                return "exited"
            kids = _children(self._unshare.pid)
            return kids[0] if kids and self._booted(kids[0]) else None
        init = cluster.poll_until(booted, timeout, 0.02)
        if init == "exited":
            err = self._unshare.stderr.read().decode(errors="replace").strip()
            self._unshare = None
            raise RuntimeError("host %s did not start: %s" % (self.name, err))
        if init is not None:
            self.init_pid = init
            return self
        self.kill()
        raise RuntimeError("host %s did not start within %ss" % (self.name, timeout))

    def _booted(self, pid):
        """True once `pid` runs `sleep` (the setup script exec'd it: mounts are in place)."""
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                return f.read().split(b"\0")[0] == b"sleep"
        except OSError:
            return False

    def running(self):
        return self._unshare is not None and self._unshare.poll() is None

    def kill(self, timeout=20):
        """SIGKILLs the host as a whole: its PID namespace's init, and so every process in it.
        Returns when they are all gone."""
        if self._unshare is None:
            return
        pids = self.pids()
        if self.init_pid is not None:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._unshare.poll() is None:
            try:
                self._unshare.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._unshare.kill()
                self._unshare.wait(timeout=timeout)
        for pid in pids:
            if not _wait_gone(pid, timeout):
                raise RuntimeError("process %d of host %s survived its host" % (pid, self.name))
        self._unshare.stderr.close()
        self._unshare = None
        self.init_pid = None

    def restart(self, empty_shm=False):
        self.kill()
        return self.start(empty_shm=empty_shm)

    def pids(self):
        """Pids (root namespace numbering) of every live process of the host but its init."""
        if self.init_pid is None:
            return []
        try:
            want = os.readlink("/proc/%d/ns/pid" % self.init_pid)
        except OSError:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.init_pid:
                continue
            try:
                if os.readlink("/proc/%s/ns/pid" % entry) == want:
                    out.append(int(entry))
            except OSError:
                pass
        return out

    def link_down(self):
        """Cuts the host off the network (its veth's root side down)."""
        _run(["ip", "link", "set", self.veth, "down"])

    def link_up(self):
        _run(["ip", "link", "set", self.veth, "up"])

    def enter_prefix(self, cwd=None):
        """A command prefix that runs a program inside this host (in all its namespaces)."""
        if self.init_pid is None:
            raise RuntimeError("host %s is not running" % self.name)
        return ["nsenter", "-t", str(self.init_pid), "--net", "--uts", "--mount", "--pid",
                "--wd=%s" % (cwd or os.getcwd()), "--"]

    def popen(self, argv, cwd=None, **kwargs):
        """subprocess.Popen of `argv` inside the host; the Popen is of nsenter, which waits for
        the program and exits with its status (or is killed with the host)."""
        return subprocess.Popen(self.enter_prefix(cwd) + list(argv), **kwargs)

    def run(self, argv, timeout=30, **kwargs):
        """subprocess.run of `argv` inside the host (output captured as text)."""
        return subprocess.run(self.enter_prefix() + list(argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def close(self):
        try:
            self.kill()
        finally:
            if self._netns_made:
                # The namespace's end of the pair goes with it, and so the root side too.
                _run(["ip", "netns", "del", self.netns], check=False)
                self._netns_made = False
            if self._veth_made:
                _run(["ip", "link", "del", self.veth], check=False)
                self._veth_made = False
            self._unmount_shm()


class HostWorld:
    """n hosts on a bridge; see the module's docstring. Use as a context manager, or call
    close() in a finally."""

    def __init__(self, n, shm_mb=512, start=True, visible=None):
        """visible: directories of this machine the hosts must see at their own path (default:
        the checkout, EFDL_BIN's directory, PYTHONPATH and the working directory); only those
        under /tmp need anything done, every other path is the same on every host anyway."""
        self.visible = _under_tmp(_default_visible() if visible is None else visible)
        self.tag = "%03x" % (os.getpid() % 0xfff)
        # 10.<200-249>.<0-249>: a subnet only these namespaces and the bridge use.
        self.prefix = "10.%d.%d" % (200 + os.getpid() % 50, (os.getpid() // 50) % 250)
        self.bridge = "efb%s" % self.tag
        self.bridge_addr = self.prefix + ".1"
        self.shm_mb = shm_mb
        self.hosts = []
        self._bridge_made = False
        self.netns_mount = NetnsMount()
        self.dir = tempfile.mkdtemp(prefix="efdl-hosts-", dir="/var/tmp")
        self.shared = os.path.join(self.dir, "shared")   # seen by every host at this path
        os.makedirs(self.shared)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._bridge_made = True
            _run(["ip", "addr", "add", "%s/24" % self.bridge_addr, "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            self.hosts = [Host(self, i + 1) for i in range(n)]
            for h in self.hosts:
                os.makedirs(h.dir)
                h._make_network()
            for h in self.hosts:
                h._write_hosts_file()
            if start:
                for h in self.hosts:
                    h.start()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable():
        """None when a world can be made here, else one line saying why not."""
        if os.geteuid() != 0:
            return "hosts need root (network, PID and mount namespaces, bridges, tmpfs mounts)"
        missing = [t for t in _TOOLS if shutil.which(t) is None]
        if missing:
            return "hosts need %s, not found on PATH" % ", ".join(missing)
        probe, mount = "efdl-probe-%d" % os.getpid(), NetnsMount()
        proc = mount.add(probe)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        mount.release()
        if proc.returncode != 0:
            return "cannot make a network namespace here: " + proc.stderr.strip()
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        errors = []
        for h in self.hosts:
            try:
                h.close()
            except Exception as e:  # noqa: BLE001 - close the others, report at the end
                errors.append("%s: %s" % (h.name, e))
        if self._bridge_made:
            _run(["ip", "link", "del", self.bridge], check=False)
            self._bridge_made = False
        self.netns_mount.release()
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("closing the host world: " + "; ".join(errors))

    def leftovers(self):
        """What of this world still exists (names of links, namespaces, mounts, /run/netns when
        this world mounted it and no namespace is left in it, the directory); empty after
        close()."""
        out = []
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        for name in [self.bridge] + [h.veth for h in self.hosts]:
            if (" %s:" % name) in links or (" %s@" % name) in links:
                out.append("link " + name)
        netns = _run(["ip", "netns", "list"], check=False).stdout.split()
        out += ["netns " + h.netns for h in self.hosts if h.netns in netns]
        with open("/proc/self/mounts") as f:
            mounts = f.read()
        out += ["mount " + h.shm_dir for h in self.hosts if (" %s " % h.shm_dir) in mounts]
        if self.netns_mount.leftover():
            out.append("mount " + NETNS_DIR)
        if os.path.exists(self.dir):
            out.append("directory " + self.dir)
        return out
