"""One replica across several pods: who is who, meeting at the leader, and dying together.

Each pod (a "node" of the group) learns from its flags or environment its index
(``--node-rank``), how many pods the replica has (``--nnodes``) and the leader's address
(``--leader-address host:port``, pod 0's). The operator sets them (a StatefulSet pod's rank is
the ordinal ending its name, ``$GOODPUT_POD_NAME``); a LeaderWorkerSet's
``LWS_WORKER_INDEX``, ``LWS_GROUP_SIZE`` and ``LWS_LEADER_ADDRESS`` are read where the flags
are absent. Each pod runs ``world / nnodes`` ranks (one process each), global ranks
``node_rank * per_node ...``; torch.distributed's store listens at the leader's address.

Before torch.distributed starts, every worker pod connects to the leader's watch port (the
store's port + 1), with a bounded wait for the pods to come up. The connection then carries a
heartbeat both ways for as long as the group runs: when a pod dies (its socket closes) or falls
silent for ``HEARTBEAT_TIMEOUT``, the other side exits non-zero, so a rank lost mid-step ends
the whole group within a bounded time (a collective waiting on a dead peer is never left to
hang) and Kubernetes restarts it as a unit.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT = 10.0
STARTUP_TIMEOUT = 600.0  # the pods of a group scheduled, pulled and started
NODE_RANK_ENV = ("GOODPUT_NODE_RANK", "LWS_WORKER_INDEX")
NNODES_ENV = ("GOODPUT_NNODES", "LWS_GROUP_SIZE")
LEADER_ENV = ("GOODPUT_LEADER_ADDRESS", "LWS_LEADER_ADDRESS")
POD_NAME_ENV = "GOODPUT_POD_NAME"  # a StatefulSet pod's name: its node rank is the ordinal that ends it
DEFAULT_PORT = 29500


class RendezvousError(RuntimeError):
    """The group cannot form: a bad address, or a pod that never came."""


def from_env(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True)
class Group:
    """This pod's place in its replica's group of pods."""

    node_rank: int = 0
    nnodes: int = 1
    leader_host: str = "127.0.0.1"
    leader_port: int = DEFAULT_PORT

    @property
    def init_method(self) -> str:
        return f"tcp://{self.leader_host}:{self.leader_port}"

    @property
    def watch_port(self) -> int:
        return self.leader_port + 1

    def ranks_per_node(self, world: int) -> int:
        if world % self.nnodes:
            raise RendezvousError(f"{world} ranks cannot be spread evenly over --nnodes {self.nnodes} pods")
        return world // self.nnodes

    def first_rank(self, world: int) -> int:
        return self.node_rank * self.ranks_per_node(world)


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``host`` (port 29500)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, DEFAULT_PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise RendezvousError(f"--leader-address {text!r}: expected HOST:PORT")
    return host, int(port)


def group_of(node_rank: int | None, nnodes: int | None, leader_address: str | None) -> Group:
    """The group from the flags, else the environment; one pod alone when neither says more."""
    rank_text = str(node_rank) if node_rank is not None else from_env(NODE_RANK_ENV)
    nodes_text = str(nnodes) if nnodes is not None else from_env(NNODES_ENV)
    address = leader_address or from_env(LEADER_ENV)
    if rank_text is None and nodes_text not in (None, "1"):
        ordinal = re.search(r"-(\d+)$", os.environ.get(POD_NAME_ENV, ""))
        rank_text = ordinal.group(1) if ordinal else None
    try:
        rank = int(rank_text) if rank_text is not None else 0
        nodes = int(nodes_text) if nodes_text is not None else 1
    except ValueError as e:
        raise RendezvousError(f"the node rank and node count must be integers: {e}") from None
    if nodes < 1 or not 0 <= rank < nodes:
        raise RendezvousError(f"--node-rank {rank} must be in [0, --nnodes {nodes})")
    if nodes == 1:
        return Group()
    if address is None:
        raise RendezvousError("--nnodes above 1 needs --leader-address (or GOODPUT_LEADER_ADDRESS)")
    host, port = parse_address(address)
    return Group(rank, nodes, host, port)


_STOPPING = threading.Event()


def stop_watching() -> None:
    """The group is ending on purpose: a peer closing its connection now is no failure."""
    _STOPPING.set()


def _die(reason: str) -> None:
    if _STOPPING.is_set():
        return
    log.error("%s; exiting so the group restarts as a unit", reason)
    logging.shutdown()
    os._exit(1)


def _heartbeat(conn: socket.socket, peer: str, on_lost: Callable[[str], None], first: float | None = None) -> None:
    """Send a byte every interval; call on_lost when the peer closes or is silent too long. `first`: how
    long the peer's first byte may take (a worker's leader may accept it late), HEARTBEAT_TIMEOUT when None."""
    first_wait = HEARTBEAT_TIMEOUT if first is None else max(first, HEARTBEAT_TIMEOUT)
    conn.settimeout(first_wait)

    def send() -> None:
        try:
            while True:
                conn.sendall(b".")
                time.sleep(HEARTBEAT_INTERVAL)
        except OSError:
            pass  # the receiving side reports it

    threading.Thread(target=send, name=f"heartbeat-{peer}", daemon=True).start()
    heard = False
    try:
        while conn.recv(64):
            if not heard:
                heard = True
                conn.settimeout(HEARTBEAT_TIMEOUT)
        on_lost(f"{peer} closed its connection")
    except TimeoutError:
        on_lost(f"{peer} sent no heartbeat for {HEARTBEAT_TIMEOUT if heard else first_wait:g}s")
    except OSError as e:
        on_lost(f"{peer} is gone ({e})")


class GroupWatch:
    """The leader's side: every worker pod connected within the startup bound, then watched."""

    def __init__(self, group: Group, on_lost: Callable[[str], None] = _die, startup: float = STARTUP_TIMEOUT):
        self.group = group
        self.on_lost = on_lost
        self.startup = startup
        self.server = socket.create_server(("", group.watch_port), reuse_port=False)

    def wait_for_workers(self) -> None:
        deadline = time.monotonic() + self.startup
        joined: dict[int, socket.socket] = {}
        while len(joined) < self.group.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.group.nnodes)) - set(joined))
                raise RendezvousError(f"pods {missing} of the group did not reach the leader within {self.startup:g}s")
            self.server.settimeout(left)
            try:
                conn, _ = self.server.accept()
                conn.settimeout(HEARTBEAT_TIMEOUT)
                # its rank's line; heartbeat bytes may already follow it when the leader comes late
                rank = int(conn.recv(16).split(b"\n")[0].decode().strip() or -1)
            except (TimeoutError, ValueError, OSError):
                continue
            joined[rank] = conn
            log.info("Pod %d of %d joined the group", rank, self.group.nnodes)
            # watched from the moment it joins: a pod that joined first must not take the wait for the
            # last one as a silent leader
            threading.Thread(
                target=_heartbeat, args=(conn, f"pod {rank}", self.on_lost), name=f"watch-{rank}", daemon=True
            ).start()


def join(group: Group, on_lost: Callable[[str], None] = _die, startup: float = STARTUP_TIMEOUT) -> None:
    """A worker pod's side: reach the leader within the startup bound, then watch it."""
    deadline = time.monotonic() + startup
    while True:
        try:
            conn = socket.create_connection((group.leader_host, group.watch_port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"the leader at {group.leader_host}:{group.watch_port} was not reachable within {startup:g}s: {e}"
                ) from None
            time.sleep(0.5)
    conn.sendall(f"{group.node_rank}\n".encode())
    # the leader's first heartbeat may come late (it accepts pods one at a time, on a busy CPU): until
    # then the start-up bound applies, the heartbeat's timeout after it
    first = max(0.0, deadline - time.monotonic())
    threading.Thread(
        target=_heartbeat, args=(conn, "the leader", on_lost, first), name="watch-leader", daemon=True
    ).start()


class HealthServer:
    """A worker pod's /health: 503 while it loads, 200 once its ranks are ready (its liveness). Asked
    ``/health?serving`` (its readiness) it always answers 503: a worker takes no requests, so only the
    group's leader is ever a ready endpoint of the service, and the leader is ready only once every
    rank of the group has joined."""

    def __init__(self, host: str, port: int) -> None:
        self.ready = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/health":
                    self.send_response(404)
                    self.end_headers()
                    return
                serving = "serving" in self.path.partition("?")[2]
                ok = outer.ready and not serving
                body = b'{"status":"ok","role":"worker"}' if outer.ready else b'{"status":"loading","role":"worker"}'
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = b'{"error":"a worker pod serves /health alone; send requests to the leader"}'
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, name="worker-health", daemon=True).start()
