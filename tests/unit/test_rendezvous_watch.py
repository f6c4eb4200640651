"""The group's watch over real sockets on this machine: pods that join the leader at different times are
all watched from the moment they join, and a pod that goes silent is reported by the other side. The
heartbeat's interval and timeout are shortened so that the test takes seconds."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from goodput_runtime.engine import rendezvous


@pytest.fixture(autouse=True)
def quick_heartbeat(monkeypatch):
    monkeypatch.setattr(rendezvous, "HEARTBEAT_INTERVAL", 0.05)
    monkeypatch.setattr(rendezvous, "HEARTBEAT_TIMEOUT", 0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group(rank: int, nnodes: int, store_port: int) -> rendezvous.Group:
    return rendezvous.Group(rank, nnodes, "127.0.0.1", store_port)


def test_a_pod_that_joined_first_outlasts_the_wait_for_the_last_one():
    """Three pods: pod 1 joins, pod 2 comes three heartbeat timeouts later. Neither side reports a loss:
    the leader heartbeats pod 1 while it waits for pod 2."""
    port = free_port() - 1  # the watch port is the store's + 1
    lost: list[str] = []
    watch = rendezvous.GroupWatch(group(0, 3, port), on_lost=lost.append, startup=30)
    waiting = threading.Thread(target=watch.wait_for_workers, daemon=True)
    waiting.start()
    rendezvous.join(group(1, 3, port), on_lost=lost.append, startup=30)
    time.sleep(3 * rendezvous.HEARTBEAT_TIMEOUT)
    assert waiting.is_alive(), "the leader waits for pod 2"
    rendezvous.join(group(2, 3, port), on_lost=lost.append, startup=30)
    waiting.join(10)
    assert not waiting.is_alive()
    time.sleep(3 * rendezvous.HEARTBEAT_TIMEOUT)
    assert lost == []


def test_a_pod_that_closes_its_connection_is_reported_by_the_leader():
    port = free_port() - 1
    lost: list[str] = []
    watch = rendezvous.GroupWatch(group(0, 2, port), on_lost=lost.append, startup=30)
    waiting = threading.Thread(target=watch.wait_for_workers, daemon=True)
    waiting.start()
    conn = socket.create_connection(("127.0.0.1", port + 1), timeout=5)
    conn.sendall(b"1\n")
    waiting.join(10)
    conn.close()
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    # closed, or reset when the leader's heartbeat was still unread at the close
    assert len(lost) == 1 and lost[0] in (
        "pod 1 closed its connection",
        "pod 1 is gone ([Errno 104] Connection reset by peer)",
    )


def test_a_worker_waits_the_start_up_bound_for_the_first_heartbeat_and_then_the_timeout():
    """A leader that accepts and stays silent (hung): the worker reports it once the start-up bound has
    passed, not after the heartbeat's timeout; one that falls silent later, after the timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1] - 1
    lost: list[str] = []
    started = time.monotonic()
    rendezvous.join(group(1, 2, port), on_lost=lost.append, startup=2.0)
    conn, _ = server.accept()
    try:
        while not lost and time.monotonic() - started < 10:
            time.sleep(0.05)
        assert lost and lost[0].startswith("the leader sent no heartbeat for 1.")
        assert time.monotonic() - started > 1.5 >= 3 * rendezvous.HEARTBEAT_TIMEOUT
        # a leader heard once, then silent: the heartbeat's timeout
        lost.clear()
        rendezvous.join(group(1, 2, port), on_lost=lost.append, startup=30)
        again, _ = server.accept()
        again.sendall(b".")
        heard = time.monotonic()
        while not lost and time.monotonic() - heard < 10:
            time.sleep(0.05)
        assert lost == [f"the leader sent no heartbeat for {rendezvous.HEARTBEAT_TIMEOUT:g}s"]
        assert time.monotonic() - heard < 5
        again.close()
    finally:
        conn.close()
        server.close()
