"""The worker side of the control socket (efdl.control) against a scripted peer.

The real agent's answers are covered by tests/agent (ControlServer, and agent_persist_test,
where python workers under a real Agent call State.flush()); here the peer is a socket server in
this process, so the client's handling of each kind of answer is checked exactly.
"""

import json
import os
import socket
import tempfile
import threading
import time

import pytest

from cluster import wait_for
from efdl import _place, control


class ScriptedAgent:
    """Accepts one connection, welcomes its hello, then answers each request with `answer`."""

    def __init__(self, answer):
        self._dir = tempfile.TemporaryDirectory(prefix="efdl-ctl-")
        self.path = os.path.join(self._dir.name, "control.sock")
        self._answer = answer
        self.requests = []
        self._listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listen.bind(self.path)
        self._listen.listen(1)
        self._listen.settimeout(10)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        conn, _ = self._listen.accept()
        with conn, conn.makefile("rwb") as f:
            for raw in f:
                msg = json.loads(raw)
                if msg["type"] == "hello":
                    out = [{"type": "welcome", "version": 1, "round": msg["round"]}]
                else:
                    self.requests.append(msg)
                    out = self._answer(msg)
                for m in out:
                    f.write((json.dumps(m) + "\n").encode())
                f.flush()

    def close(self):
        self._listen.close()
        self._thread.join(10)
        self._dir.cleanup()


@pytest.fixture
def agent_with():
    made = []

    def make(answer):
        agent = ScriptedAgent(answer)
        made.append(agent)
        return agent, control.ControlClient(agent.path, rank=0, local_rank=0, round_=4)
    yield make
    for a in made:
        a.close()


def test_flush_request_carries_scope_and_timeout_and_returns_the_agents_answer(agent_with):
    agent, client = agent_with(lambda m: [{"type": "reply", "id": m["id"], "persisted": True}])
    with client:
        assert client.request_flush("rank3", timeout=2.5) is True
    assert agent.requests[0]["type"] == "flush"
    assert agent.requests[0]["scope"] == "rank3"
    assert agent.requests[0]["timeout_ms"] == 2500


def test_flush_on_a_node_that_does_not_store_the_arena_returns_false(agent_with):
    _, client = agent_with(lambda m: [{"type": "reply", "id": m["id"], "persisted": False}])
    with client:
        assert client.request_flush("node", timeout=5) is False


def test_flush_failure_is_a_control_error_with_the_agents_reason(agent_with):
    _, client = agent_with(lambda m: [{"type": "error", "id": m["id"],
                                       "message": "no space left on device"}])
    with client, pytest.raises(control.ControlError, match="no space left on device"):
        client.request_flush("node", timeout=5)


def test_a_stop_arriving_while_waiting_ends_the_flush_and_is_kept(agent_with):
    # The agent persists after the worker exits, and its loop may be busy stopping workers
    # rather than answering: the flush must not wait for it.
    _, client = agent_with(lambda m: [{"type": "stop", "round": 4, "graceful": True,
                                       "reason": "scale out"}])
    with client:
        assert client.request_flush("node", timeout=5) is False
        assert client.stop_requested()
        assert client.stop_request().reason == "scale out"
        assert client.request_flush("node", timeout=5) is False  # no request once stopping


def test_answers_to_other_requests_are_not_taken_for_the_flushes(agent_with):
    answers = iter([[{"type": "reply", "id": 999, "persisted": False},
                     {"type": "reply", "id": 1, "persisted": True}]])
    _, client = agent_with(lambda m: next(answers))
    with client:
        assert client.request_flush("node", timeout=5) is True


def test_an_agent_that_never_answers_is_a_bounded_wait(agent_with, monkeypatch):
    monkeypatch.setattr(control, "_FLUSH_ANSWER_MARGIN_S", 0.3)
    _, client = agent_with(lambda m: [])
    with client, pytest.raises(control.ControlError, match="did not answer"):
        client.request_flush("node", timeout=0.2)


class StoppedClock:
    """Stands in for the time module in efdl.control: monotonic_ns() moves only when told, so
    the rate limits are checked by counts, however slowly a loaded machine runs the loop."""

    def __init__(self):
        self.ns = time.monotonic_ns()

    def advance(self, seconds):
        self.ns += int(seconds * 1e9)

    def monotonic_ns(self):
        return self.ns

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch):
    c = StoppedClock()
    monkeypatch.setattr(control, "time", c)
    return c


def test_committed_is_sent_at_most_every_100_ms(agent_with, clock):
    agent, client = agent_with(lambda m: [{"type": "reply", "id": m["id"], "persisted": True}]
                               if m["type"] == "flush" else [])
    with client:
        for step in range(1, 201):   # a commit every step: one message, not 200
            client.notify_committed(step)
            clock.advance(0.0004)    # 200 steps in 80 ms
        clock.advance(0.02)
        client.notify_committed(201)  # the interval is over: sent
        client.notify_committed(202)
        # The answer to a later request: the peer has read everything sent before it.
        assert client.request_flush("node", timeout=5) is True
    steps = [m["step"] for m in agent.requests if m["type"] == "committed"]
    assert steps == [1, 201]


def test_stop_requested_reads_the_socket_at_most_every_10_ms_and_sees_a_stop(agent_with, clock):
    agent, client = agent_with(lambda m: [{"type": "stop", "round": 4, "graceful": True,
                                           "reason": "scale out"}]
                               if m["type"] == "query" else [])
    reads = []
    real_read = client._read_available
    client._read_available = lambda: (reads.append(1), real_read())[1]
    with client:
        for _ in range(250):   # 50 ms of steps that each call commit(), one every 0.2 ms
            assert not client.stop_requested()
            clock.advance(0.0002)
        assert len(reads) == 5, reads   # at 0, 10, 20, 30 and 40 ms
        client._send({"type": "query", "id": 1, "what": "restore"})  # the peer answers 'stop'
        deadline = time.monotonic() + 30
        while not client.stop_requested():
            assert time.monotonic() < deadline, "the stop request was never seen"
            clock.advance(0.001)
            time.sleep(0.001)
        assert client.stop_request().graceful is True


def test_stopping_says_whether_the_process_may_hold_gpu_memory(agent_with, monkeypatch):
    """The agent starts the next round's worker while this one exits only when `gpu` is false:
    GPU memory is freed at the exit. No CUDA here, so false; a framework whose GPU use cannot be
    seen (TensorFlow, JAX) makes it true."""
    import sys
    agent, client = agent_with(lambda m: [])
    with client:
        client.notify_stopping(12)
        monkeypatch.setitem(sys.modules, "tensorflow", sys)
        client.notify_stopping(13)
        deadline = time.monotonic() + 10
        while len(agent.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [(m["type"], m["step"], m["gpu"]) for m in agent.requests] == [
        ("stopping", 12, False), ("stopping", 13, True)]


# -- in-process round changes (efdl.elastic.run) -------------------------------------------------

def _in_process_agent(msg):
    """Answers "in_process" with a pause of round 4, and "paused" with round 5's place."""
    if msg["type"] == "in_process":
        return [{"type": "in_process", "round": 4, "accepted": True},
                {"type": "pause", "round": 4, "graceful": True, "reason": "node b joined"}]
    if msg["type"] == "paused":
        return [{"type": "round", "round": 3, "env": {"RANK": "9"}},   # an old one: ignored
                {"type": "round", "round": 5, "env": {"RANK": "7", "LOCAL_RANK": "1",
                                                      "WORLD_SIZE": 8}}]
    return []


def test_a_pause_is_seen_as_a_stop_request_and_the_next_round_brings_its_place(agent_with,
                                                                               monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "EFDL_ROUND"):
        monkeypatch.delenv(var, raising=False)   # apply() writes them; restored afterwards
    agent, client = agent_with(_in_process_agent)
    with client:
        client.announce_in_process()
        wait_for(client.stop_requested, 5.0, "the pause as a stop request", interval=0.01)
        assert client.stop_request() is None, "a pause is not a stop"
        assert client.pause_request().reason == "node b joined"
        client.notify_paused(12, snapshot=True)
        place = client.wait_for_round(timeout=5)
        assert place.env == {"RANK": "7", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}
        assert (place.round, place.rank, place.local_rank, place.world_size) == (5, 7, 1, 8)
        assert client.round == 4, "the place is the client's once applied, not before"
        _place.apply(place, client)
        assert client.place is place
        assert (client.round, client.rank, client.local_rank) == (5, 7, 1)
        assert (os.environ["EFDL_ROUND"], os.environ["RANK"]) == ("5", "7")
        assert _place.current(client) is place
        assert client.pause_request() is None and not client.stop_requested()
    assert agent.requests[1] == {"type": "paused", "round": 4, "step": 12, "snapshot": True}


def test_a_pause_reaches_only_a_worker_that_announced_in_process(agent_with):
    def answer(m):
        if m["type"] == "committed":
            return [{"type": "pause", "round": 4, "graceful": True, "reason": "x"}]
        return [{"type": "reply", "id": m["id"], "restore_step": 1}]
    _, client = agent_with(answer)
    with client:
        client._send({"type": "committed", "step": 1})
        # The peer answers in order: once the query's reply is in, the pause sent before it was
        # read and handled too (a fixed pause could end before it arrives, and show nothing).
        assert client.query_restore_step(timeout=10) == 1
        assert client.pause_request() is None
        assert not client.stop_requested(), "a plain worker is stopped, never paused"


def test_announcing_in_process_waits_for_the_agents_answer(agent_with):
    _, client = agent_with(lambda m: [{"type": "in_process", "round": 4, "accepted": True}])
    with client:
        assert client.announce_in_process() is True
    _, old_agent = agent_with(lambda m: [{"type": "error", "message": "unknown request type"}])
    with old_agent:
        assert old_agent.announce_in_process() is False, "an agent without in-process rounds"


def test_a_stop_while_waiting_for_the_next_round_ends_the_wait(agent_with):
    _, client = agent_with(lambda m: [{"type": "stop", "round": 4, "graceful": True,
                                       "reason": "standby"}] if m["type"] == "paused" else [])
    with client:
        client.announce_in_process(timeout=0.2)
        client.notify_paused(3, snapshot=True)
        assert client.wait_for_round(timeout=5) is None
        assert client.stop_request().reason == "standby"


def test_a_failure_report_carries_the_round_and_the_message(agent_with):
    agent, client = agent_with(lambda m: [])
    with client:
        client.notify_failed("RuntimeError: Connection closed by peer")
        wait_for(lambda: agent.requests, 5.0, "the failure report", interval=0.01)
    assert agent.requests[0] == {"type": "failed", "round": 4,
                                 "message": "RuntimeError: Connection closed by peer"}


def test_an_agent_gone_while_waiting_for_the_next_round_is_a_stop(agent_with):
    agent, client = agent_with(lambda m: [])
    with client:
        client.announce_in_process(timeout=0.2)
        agent._listen.close()
        client._sock.shutdown(socket.SHUT_RDWR)   # the agent's end closes
        assert client.wait_for_round(timeout=5) is None
