"""Links between neighbouring node agents: a cut between two nodes reported in seconds
where the collectives' own traffic cannot tell us (NCCL's).

A cut between two nodes that both still reach the daemon leaves every heartbeat
going: the daemon sees nothing wrong. The CPU ring watches its own TCP links
(``ring_wire.watch_link``), but NCCL's sockets are NCCL's: a collective across the cut
hangs until ``collective_timeout_s`` (300 s). So, for such backends, each node agent
keeps one idle TCP link to the next node's agent (node n dials node n+1 mod N), with
the same kernel-level watch: keepalive probes every second and a TCP user timeout of
``LINK_SILENCE_S``. A live host's kernel acknowledges them even while its processes
are stopped or busy, so only a cut network or a host that is gone ends a link that
way; a process that exits closes its end, which is not reported here (the daemon
already tells everyone of a dead agent). Any partition of the nodes into two groups
cuts at least two links of the ring, so both sides hear of it.

The links carry no data. Each is authenticated as the CPU ring's connections are
(``peer_auth``, keyed by the generation's id, node ranks as ranks), so that no one
else can hold a node's link open, or end it, to fail the job. Addresses go through
the generation's key-value store (``node-link/<node>``). A link that cannot be set
up leaves only that pair unwatched (logged), it fails nothing: the collectives' own
timeouts remain.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rendezvousd.client.membership import Membership, NodeMembership
from rendezvousd.common.escape import shortened
from rendezvousd.trainer.comm import peer_auth
from rendezvousd.trainer.comm.ring_wire import (
    LINK_SILENCE_S,
    create_listener,
    link_error,
    watch_link,
)

__all__ = ["LINK_SETTLE_S", "MAX_HANDSHAKES", "LinkSilent", "NodeLinks"]

# A link that went silent is reported only if the daemon has not told of a failure
# within this long: a host that is gone is also lost to its heartbeat timeout, and the
# daemon's word names that host, where ours names the link.
LINK_SETTLE_S = 2.0

_MAGIC = b"rdzvlink"
# Handshakes in progress at once: each holds a thread for at most LINK_SILENCE_S, and
# connections beyond these are closed at once, so strangers cannot pile up threads.
MAX_HANDSHAKES = 64
# Errors with which the kernel ends a link whose peer host stopped answering: the
# user timeout itself, or an ICMP error a router sent meanwhile, reported in its place.
_SILENT = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH}


class LinkStore(Protocol):
    """A client of the daemon of its own, which the links attach as the node's first
    rank (the key-value store answers members, not nodes) and close with them: a
    client per generation, so a slow link thread cannot publish into the next one."""

    def attach(self, membership: Membership, instance_id: str) -> None: ...

    def kv_set(self, key: str, value: bytes) -> None: ...

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LinkSilent:
    """The link to another node went silent in ``generation``; ``cause`` names it.
    ``connected``: it had been up; False: its host never answered this generation's
    connection attempt (a cut still there when the job formed again)."""

    generation: int
    cause: str
    connected: bool = True


class NodeLinks:
    """This node's links in one generation: ``start()`` sets them up on threads of their
    own; ``on_silent(LinkSilent)`` is called at most once; ``close()`` ends them.
    ``host``: the address to listen on and publish; ``name``: what the other nodes'
    reports call this one (the host the daemon records for its ranks)."""

    def __init__(
        self,
        store: LinkStore,
        node: NodeMembership,
        *,
        host: str,
        name: str,
        on_silent: Callable[[LinkSilent], None],
        note: Callable[[str], None],
        setup_timeout: float,
    ) -> None:
        try:
            # No I/O: the worker of the node's first rank attaches as the same member.
            store.attach(node.membership_for(0), node.member_instance_id(0))
        except BaseException:
            store.close()
            raise
        self._store = store
        self.generation = node.generation
        self._node = node.node_rank
        self._nodes = node.num_nodes
        self._gpus = node.gpus_per_node
        self._host = host
        self._name = name
        self._on_silent = on_silent
        self._note = note
        self._setup_timeout = setup_timeout
        key = peer_auth.derive_key(node.unique_id)
        self._auth = peer_auth.PeerAuth(key, _MAGIC, node.node_rank, node.num_nodes)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        # Set by close(): a dial refused by a neighbour that is itself closing waits on it.
        self._closing = threading.Event()
        self._reported = False
        self._handshakes = 0
        # Each linked neighbour's host name, for the report (from its published entry).
        self._names: dict[int, str] = {}
        #: The neighbours whose links are up (and watched).
        self.linked: set[int] = set()

    def start(self) -> None:
        """Nothing to watch for a job of one node."""
        if self._nodes < 2:
            return
        threading.Thread(target=self._dial, name="node-link-dial", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._closing.set()
        for sock in sockets:
            # shutdown wakes a thread blocked on the socket; close alone would not.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        # Also ends a wait for the next node's address still in flight.
        self._store.close()

    # -- set-up -----------------------------------------------------------------

    def _keep(self, sock: socket.socket) -> bool:
        """Keep ``sock`` to be closed with the links; False (and it is closed) if the
        links already were."""
        with self._lock:
            if not self._closed:
                self._sockets.append(sock)
                return True
        sock.close()
        return False

    def _dial(self) -> None:
        right = (self._node + 1) % self._nodes
        left = (self._node - 1) % self._nodes
        try:
            listener = create_listener(self._host)
        except OSError as exc:
            self._unwatched(left, f"cannot listen on {self._host}: {exc.strerror}")
            return
        if not self._keep(listener):
            return
        threading.Thread(
            target=self._accept, args=(listener, left), name="node-link-accept", daemon=True
        ).start()
        where = {"host": self._host, "port": listener.getsockname()[1], "name": self._name}
        try:
            self._store.kv_set(f"node-link/{self._node}", json.dumps(where).encode())
            value = self._store.kv_get(f"node-link/{right}", timeout=self._setup_timeout)
            peer = json.loads(value)
            host, port = str(peer["host"]), int(peer["port"])
            self._names[right] = str(peer.get("name", host))
        except Exception as exc:  # the store's errors, or a value no agent of ours wrote
            self._unwatched(right, f"{type(exc).__name__}: {exc}")
            return
        try:
            # Its agent listened before it published: a host that answers no connection
            # attempt for LINK_SILENCE_S is as silent as one that stops answering later
            # (a generation formed again across a cut that is still there).
            sock = socket.create_connection((host, port), timeout=LINK_SILENCE_S)
        except OSError as exc:
            if isinstance(exc, TimeoutError) or exc.errno in _SILENT:
                self._silent(right, exc, connected=False, at=f"{host}:{port}")
            else:
                self._unwatched(right, f"cannot connect to {host}:{port}: {exc}", settle=True)
            return
        if not self._keep(sock):
            return
        try:
            peer_auth.dial(sock, self._auth, right, f"node {self._node}: node {right}'s agent")
        except Exception as exc:  # PeerConnectionError, CommunicatorTimeout, OSError
            self._unwatched(right, str(exc), settle=True)
            return
        self._watch(sock, right)

    def _accept(self, listener: socket.socket, left: int) -> None:
        """Each connection's handshake on a thread of its own, until the left
        neighbour's agent is linked: a stranger that connects and says nothing holds
        only its own thread, for ``LINK_SILENCE_S``, never the neighbour's link; beyond
        ``MAX_HANDSHAKES`` at once, connections are closed unread."""
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed: the generation ended, or the neighbour is linked
            with self._lock:
                admitted = self._handshakes < MAX_HANDSHAKES
                self._handshakes += admitted
            if not admitted:
                sock.close()
                continue
            if not self._keep(sock):
                return
            threading.Thread(
                target=self._handshake,
                args=(listener, sock, left),
                name="node-link-handshake",
                daemon=True,
            ).start()

    def _handshake(self, listener: socket.socket, sock: socket.socket, left: int) -> None:
        try:
            # The neighbour dials once it read our address, and answers in milliseconds.
            sock.settimeout(LINK_SILENCE_S)
            peer_auth.accept(sock, self._auth, lambda rank: rank == left, "node link port")
        except Exception:  # a stranger, or a handshake cut short: not a link
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close()
            return
        finally:
            with self._lock:
                self._handshakes -= 1
        with contextlib.suppress(OSError):
            # Wakes the accepting thread (close alone would not); closed with the links.
            listener.shutdown(socket.SHUT_RDWR)
        # Published before it dialed: for the report only, so any error just leaves the
        # name out.
        with contextlib.suppress(Exception):
            entry = self._store.kv_get(f"node-link/{left}", wait=False)
            self._names[left] = str(json.loads(entry)["name"])
        self._watch(sock, left)

    def _unwatched(self, peer: int, why: str, *, settle: bool = False) -> None:
        """``settle``: a refusal a neighbour whose generation just ended gives as well as
        a stranger does (it closes its listener and its handshakes): this node hears of
        that end from the daemon within moments and closes the links, so wait that long
        before saying the pair is unwatched."""
        if settle:
            self._closing.wait(LINK_SETTLE_S)
        if not self._closed:
            self._note(
                f"warning: the link to node {peer}'s agent is not watched in generation "
                f"{self.generation} ({why}); a cut between these nodes is noticed only at "
                "the collectives' own timeouts"
            )

    # -- the watch ----------------------------------------------------------------

    def _watch(self, sock: socket.socket, peer: int) -> None:
        try:
            sock.settimeout(None)
            watch_link(sock)
            with self._lock:
                self.linked.add(peer)
            # Nothing is ever sent: this returns when the peer's end closes.
            sock.recv(1)
        except OSError as exc:  # also EBADF: the links were closed meanwhile
            if exc.errno in _SILENT and not self._closed:
                self._silent(peer, exc)

    def _silent(
        self, peer: int, exc: OSError, *, connected: bool = True, at: str | None = None
    ) -> None:
        """``at``: the address dialed, said where the link never connected (an address
        the others cannot reach is then as likely as a cut)."""
        with self._lock:
            if self._reported or self._closed:
                return
            self._reported = True
        first = peer * self._gpus
        ranks = f"rank {first}" if self._gpus == 1 else f"ranks {first}-{first + self._gpus - 1}"
        if exc.errno in (errno.ETIMEDOUT, None):  # the kernel's user timeout, or our connect's
            what = link_error(OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT)))
        else:
            what = f"its host {'became' if connected else 'is'} unreachable ({exc.strerror})"
        # The name is the neighbour's entry's (a member wrote it): escaped, cut short.
        on = f" on {shortened(self._names[peer], 64)}" if peer in self._names else ""
        verb = "lost the link to" if connected else "could not link to"
        where = f" at {shortened(at, 80)}" if at else ""
        cause = f"{verb} node {peer}{on} ({ranks}){where}: {what}"
        self._on_silent(LinkSilent(self.generation, cause, connected))
