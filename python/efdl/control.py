"""Worker-side client of the node agent's control socket (docs/control-protocol.md).

A worker started by `efdl run` finds its agent's socket in EFDL_CONTROL_SOCKET. The client is
not thread-safe: use it from one thread (the training loop). It holds no etcd connection and
starts no thread, so it is safe in a process that forks (DataLoader workers).
"""

import json
import os
import socket
import sys
import time

from efdl._names import PROTOCOL_VERSION, Env, Msg
from efdl._place import RoundPlace, int_or as _int_or

ENV_SOCKET = Env.CONTROL_SOCKET

# stop_requested() reads the socket at most this often; between reads it returns a cached flag,
# so a per-step call costs well under a microsecond. A read that finds nothing costs about 5 us
# here (a recv() syscall and its exception): every 10 ms, not on every 1 ms step. A stop request
# waits at most that long, against the seconds of --stop-grace.
_POLL_INTERVAL_NS = 10_000_000
_MAX_LINE = 64 * 1024
# `committed` notifications go out at most this often (the protocol calls them low rate): with a
# commit every step, one message per commit cost a send() here and a parse in the agent each step.
_COMMITTED_INTERVAL_NS = 100_000_000
# A flush's answer may come this long after the agent's own timeout (its loop turn, the wire).
_FLUSH_ANSWER_MARGIN_S = 10.0



def uses_gpu():
    """Whether this process may hold GPU memory: it initialized CUDA through torch, or imported
    a framework whose GPU use this cannot see (TensorFlow, JAX)."""
    if "tensorflow" in sys.modules or "jax" in sys.modules:
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a broken CUDA setup: keep the agent waiting for the exit
        return True

class ControlError(Exception):
    """The agent could not be reached or answered something unexpected."""


class StopRequest:
    """What the agent said when it asked this worker to leave its round ("stop"), or, for an
    in-process worker, to pause at the close of its round ("pause")."""

    __slots__ = ("round", "graceful", "reason")

    def __init__(self, round_, graceful, reason):
        self.round = round_
        self.graceful = graceful
        self.reason = reason

    def __repr__(self):
        return "StopRequest(round=%r, graceful=%r, reason=%r)" % (self.round, self.graceful,
                                                                  self.reason)


class ControlClient:
    """A connection to the agent. Connects and says hello in the constructor.

    `place` is the RoundPlace this worker holds (efdl/_place.py): its round, rank and local rank,
    read through the properties of the same names. wait_for_round() returns the next one, which
    efdl._place.apply() makes the client's (and the process environment's)."""

    def __init__(self, path, rank=0, local_rank=0, round_=0, timeout=5.0, place=None):
        self.path = path
        self.place = place if place is not None else RoundPlace(round_, rank, local_rank)
        self._buf = b""
        self._stop = None
        self._pause = None           # a "pause" of the current round (in-process workers)
        self._next_round = None      # a "round" message not yet taken (wait_for_round)
        self._in_process = False
        self._closed = False
        self._next_id = 1
        self._next_poll_ns = 0
        self._next_committed_ns = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            self._send({"type": Msg.HELLO, "version": PROTOCOL_VERSION, "pid": os.getpid(),
                        "rank": self.rank, "local_rank": self.local_rank,
                        "round": self.round})
            self.welcome = self._wait_for(lambda m: m.get("type") in (Msg.WELCOME, Msg.STOP),
                                          timeout)
        except OSError as e:
            self._sock.close()
            raise ControlError("cannot reach the efdl agent at %s: %s" % (path, e)) from None
        self._sock.setblocking(False)

    @property
    def round(self):
        return self.place.round

    @property
    def rank(self):
        return self.place.rank

    @property
    def local_rank(self):
        return self.place.local_rank

    # -- stop requests -------------------------------------------------------------------------

    def stop_requested(self):
        """True once the agent asked this worker to stop or, in-process, to pause (or went
        away). Non-blocking, cheap."""
        if self._stop is not None or self._pause is not None:
            return True
        now = time.monotonic_ns()
        if now < self._next_poll_ns:
            return False
        self._next_poll_ns = now + _POLL_INTERVAL_NS
        self._read_available()
        return self._stop is not None or self._pause is not None

    def stop_request(self):
        """The StopRequest of a "stop", or None while none arrived."""
        self.stop_requested()
        return self._stop

    def pause_request(self):
        """The StopRequest of a "pause" of the current round, or None while none arrived."""
        self.stop_requested()
        return self._pause

    # -- in-process round changes (efdl.elastic.run) -------------------------------------------

    def announce_in_process(self, timeout=5.0):
        """Tells the agent that this worker takes round changes in-process: at a round's close
        it is sent "pause" instead of "stop", and then the next round's place ("round").
        Returns once the agent answered (True: counted from now on), False when it did not
        (an agent that is gone, or one that predates in-process rounds: it stops the worker
        at round changes, as for a program without efdl.elastic.run)."""
        self._in_process = True
        try:
            self._send({"type": Msg.IN_PROCESS, "round": self.round})
            answer = self._wait_for(lambda m: m.get("type") in (Msg.IN_PROCESS, Msg.ERROR), timeout)
        except (OSError, ControlError):
            return False
        return answer.get("type") == Msg.IN_PROCESS and bool(answer.get("accepted", True))

    def notify_failed(self, message):
        """A collective of the current round failed here: the agent has the round formed again
        (sent before the process group is torn down, which may take a while)."""
        self._send_quiet({"type": Msg.FAILED, "round": self.round, "message": str(message)[:1000]})

    def notify_raised(self, message):
        """The program raised `message` on this rank (not a collective failure): sent before the
        process tears down, so that the agent counts it as this node's failure at once."""
        self._send_quiet({"type": Msg.RAISED, "round": self.round, "message": str(message)[:1000]})

    def notify_returned(self):
        """The program returned (or exited 0) on this rank: sent before its process group is
        torn down, so that the agent blames a failure of a rank beside it on this early exit."""
        self._send_quiet({"type": Msg.RETURNED, "round": self.round})

    def notify_paused(self, step, snapshot):
        """This worker left the current round (its process group is destroyed) and waits for
        the next; `snapshot`: it took a snapshot of `step` at the pause (False: it goes back to
        its newest snapshot, after a failure)."""
        self._send_quiet({"type": Msg.PAUSED, "round": self.round,
                          "step": -1 if step is None else int(step), "snapshot": bool(snapshot)})

    def wait_for_round(self, timeout=None):
        """Blocks until the agent gives this worker its place in the next round: returns it (a
        RoundPlace: round, rank, local rank, world size and the environment a worker started for
        that round gets), or None when the agent asks it to stop instead (or went away). The
        place becomes this client's when efdl._place.apply() takes it. `timeout` (seconds,
        None: no limit) raises ControlError when it passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._next_round is not None:
                message, self._next_round = self._next_round, None
                place = RoundPlace.from_message(message, self.place)
                if place is not None:
                    self._pause = None
                    return place
            if self._stop is not None:
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ControlError("the efdl agent gave no next round within %.1f s" % timeout)
            try:
                self._wait_for(lambda m: m.get("type") in (Msg.ROUND, Msg.STOP),
                               left if left is not None else 3600.0)
            except ControlError:
                if self._stop is not None:
                    return None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    # -- notifications -------------------------------------------------------------------------

    def notify_committed(self, step):
        """A snapshot of `step` is complete in the node's memory. Sent at most every 100 ms (a
        commit every step would send one message per step); commits in between are not
        reported, and the final step of a graceful stop goes out with `stopping`."""
        now = time.monotonic_ns()
        if now < self._next_committed_ns:
            return
        self._next_committed_ns = now + _COMMITTED_INTERVAL_NS
        self._send_quiet({"type": Msg.COMMITTED, "step": int(step)})

    def notify_persisted(self, step):
        """The snapshot of `step` is durable in storage (sent after a successful flush)."""
        self._send_quiet({"type": Msg.PERSISTED, "step": int(step)})

    def notify_stopping(self, step, snapshot=True):
        """Answer to a stop request: this worker exits 0 after the snapshot of `step`. `gpu`
        tells the agent whether it must wait for this process' exit (GPU memory is freed only
        then) before starting the next round's worker; without a GPU it starts it at once."""
        round_ = self._stop.round if self._stop is not None else self.round
        self._send_quiet({"type": Msg.STOPPING, "round": round_, "step": int(step),
                          "snapshot": bool(snapshot), "gpu": uses_gpu()})

    def query_restore_step(self, timeout=5.0):
        """The newest step this node's workers reported, or None when none did."""
        request_id = self._next_id
        self._next_id += 1
        self._send({"type": Msg.QUERY, "id": request_id, "what": Msg.QUERY_RESTORE})
        reply = self._wait_for(lambda m: m.get("id") == request_id, timeout)
        if reply.get("type") == Msg.ERROR:
            raise ControlError("agent refused the query: %s" % reply.get("message"))
        step = reply.get("restore_step")
        return None if step is None else int(step)

    def request_flush(self, scope, timeout):
        """Asks the agent to persist the newest snapshot of arena `scope` ("node", "rank<N>")
        now and waits for it. Returns True when the agent wrote it (or storage had it), False
        when this node does not write that arena to storage (the rank-0 node stores the same
        step) or when a stop request arrived meanwhile (the agent persists at the stop anyway).
        Raises ControlError when the agent reports a failure or does not answer in time."""
        if self._stop is not None:
            return False
        request_id = self._next_id
        self._next_id += 1
        self._send({"type": Msg.FLUSH, "id": request_id, "scope": scope,
                    "timeout_ms": int(max(0.0, timeout) * 1000)})
        reply = self._wait_for(lambda m: m.get("id") == request_id or m.get("type") == Msg.STOP,
                               max(0.0, timeout) + _FLUSH_ANSWER_MARGIN_S)
        if reply.get("type") == Msg.STOP:
            return False
        if reply.get("type") == Msg.ERROR:
            raise ControlError("the agent could not persist the snapshot: %s"
                               % reply.get("message"))
        return bool(reply.get("persisted"))

    def close(self):
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _send(self, message):
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        blocking = self._sock.gettimeout()
        self._sock.settimeout(5.0)
        try:
            self._sock.sendall(data)
        finally:
            self._sock.settimeout(blocking)

    def _send_quiet(self, message):
        # A notification to an agent that is gone is not an error for the training loop.
        try:
            self._send(message)
        except OSError:
            self._mark_gone("connection to the agent lost")

    def _mark_gone(self, reason):
        if self._stop is None:
            self._stop = StopRequest(self.round, False, reason)

    def _handle(self, message):
        kind = message.get("type")
        if kind == Msg.STOP and self._stop is None:
            self._stop = StopRequest(message.get("round", self.round),
                                     bool(message.get("graceful", False)),
                                     message.get("reason", ""))
        elif kind == Msg.PAUSE and self._pause is None and self._in_process:
            round_ = _int_or(message.get("round"), self.round)
            if round_ >= self.round:   # not one of a round this worker already left
                self._pause = StopRequest(round_, bool(message.get("graceful", False)),
                                          message.get("reason", ""))
        elif kind == Msg.ROUND and _int_or(message.get("round"), -1) > self.round:
            self._next_round = message

    def _take_lines(self):
        messages = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line, self._buf = self._buf[:nl], self._buf[nl + 1:]
            if not line.strip():
                continue
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._handle(message)
                messages.append(message)
        if len(self._buf) > _MAX_LINE:
            self._buf = b""
        return messages

    def _read_available(self):
        while True:
            try:
                chunk = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._mark_gone("connection to the agent lost")
                break
            if not chunk:
                self._mark_gone("the agent closed the control socket")
                break
            self._buf += chunk
        return self._take_lines()

    def _wait_for(self, predicate, timeout):
        deadline = time.monotonic() + timeout
        while True:
            for message in self._take_lines():
                if predicate(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlError("the efdl agent did not answer within %.1f s" % timeout)
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:
                self._mark_gone("connection to the agent lost")
                raise ControlError("connection to the efdl agent lost: %s" % e) from None
            finally:
                self._sock.setblocking(False)
            if not chunk:
                self._mark_gone("the agent closed the control socket")
                raise ControlError("the efdl agent closed the control socket")
            self._buf += chunk


def connect_from_env(timeout=5.0):
    """A ControlClient for this worker's agent, or None when not running under `efdl run`."""
    path = os.environ.get(ENV_SOCKET)
    if not path:
        return None
    # Unset or empty: rank 0, round 0; anything else, blanks too, must be an integer.
    place = RoundPlace.from_environment(default_round=0,
                                        message="%(name)s=%(value)r is not an integer",
                                        error=ControlError)
    return ControlClient(path, timeout=timeout, place=place)
