"""A small HTTP/1.1 server on the daemon's asyncio loop: /metrics and the status page.

prometheus_client's server starts a thread per connection, without a cap, so a
client opening connections could make the daemon start threads without bound
(issue 21). This one runs on the event loop that already serves gRPC, with a
fixed number of connections, bounded request heads and bodies, and timeouts for
a client that sends a request slowly or never. It is not a general web server:
one request at a time per connection, Content-Length bodies only. aiohttp or
uvicorn were the alternatives: a dependency tree (uvicorn's an ASGI stack too) for
a handful of GET routes and one POST, with a whole-request-head deadline and a
connection cap still to be added around them; this is that and only that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote, urlsplit

from rendezvousd.common.escape import shortened
from rendezvousd.common.log_throttle import LogThrottle

log = logging.getLogger("rendezvousd.http")

MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 16 * 1024
# The table's size bounds what the port can cost the daemon (descriptors shared with
# gRPC's, and up to 32 KiB of buffered head and body each: 2 MiB in all), far above
# what its users need (a scraper or two, a browser's 6 per host per tab). It is not
# what keeps them served: a full table makes room for a newcomer by closing a
# connection that waits on its client (below), so filling it, from any number of
# addresses, shuts nobody out. Refusing the newcomer instead let 4 addresses x 16
# connections, each kept alive by one request per IDLE_S, keep every scrape and the
# status page out for as long as they went on (h121 F3).
MAX_CONNECTIONS = 64
# One client address's share (a browser opens 6 per host, a scraper 1), its next
# connection answered 503 rather than making room: one host alone holds at most a
# quarter of the table, and churning its connections closes only its own.
MAX_CONNECTIONS_PER_PEER = 16
# A request's head and body must arrive within this; an idle kept-alive connection
# is closed after IDLE_S.
REQUEST_TIMEOUT_S = 10.0
IDLE_S = 30.0
# An error no request should cause (a bug) is logged at most once per this long, with
# a count of the rest: anyone who reaches the port can repeat the request that causes
# it, and a line with a traceback per request filled 4 MB of log in 3 s (h121 F2).
ERROR_LOG_EVERY_S = 10.0


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: str


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], Awaitable[Response]]


class HttpError(Exception):
    """A request this server refuses before any handler sees it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class _Connection:
    address: str
    task: asyncio.Task[None]
    writer: asyncio.StreamWriter
    # When it began waiting on its client (accepted, or its last answer sent): the
    # connection that has waited longest is the first a full table closes.
    since: float
    # Its handler is running: the daemon's time, not the client's; never closed for room.
    busy: bool = False


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._handler = handler
        self._ssl = ssl_context
        self._open: dict[asyncio.Task[None], _Connection] = {}
        self._per_peer: dict[str, int] = {}
        self._errors: LogThrottle[None] = LogThrottle(ERROR_LOG_EVERY_S)
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(
            self._connection,
            host,
            port,
            ssl=self._ssl,
            limit=MAX_HEAD_BYTES,
            ssl_handshake_timeout=REQUEST_TIMEOUT_S if self._ssl else None,
            reuse_address=True,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        # Aborted, not cancelled, as for room (_make_room): a cancelled connection task
        # was an ERROR with a traceback per open connection at every stop, on 3.11.
        for conn in list(self._open.values()):
            conn.writer.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5)
        self._server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peername = writer.get_extra_info("peername")
        address = str(peername[0]) if isinstance(peername, tuple) else "unix"
        peer = f"{address}:{peername[1]}" if isinstance(peername, tuple) else "unix"
        try:
            held = self._per_peer.get(address, 0)
            if held >= MAX_CONNECTIONS_PER_PEER or (
                len(self._open) >= MAX_CONNECTIONS and not self._make_room()
            ):
                # Over a cap: answered and closed at once, so it holds no slot.
                with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError):
                    await _send(writer, Response(503, b"too many connections\n"), close=True)
                return
            conn = _Connection(address, task, writer, time.monotonic())
            self._open[task] = conn
            self._per_peer[address] = held + 1
            try:
                await self._serve(reader, writer, peer, conn)
            finally:
                self._forget(conn)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        except Exception:
            # Nothing a client sends may reach asyncio's "Unhandled exception in
            # client_connected_cb" (ERROR, a traceback, no limit): a bug, counted.
            self._log_error(f"a connection from {peer} failed")
        finally:
            await _close(writer)

    def _make_room(self) -> bool:
        """Closes one connection that waits on its client, for a newcomer: of the
        address holding the most, the one waiting longest. An address holding few (a
        scraper's one) is the last to lose one, however many addresses fill the table."""
        waiting = [c for c in self._open.values() if not c.busy]
        if not waiting:
            return False
        victim = max(waiting, key=lambda c: (self._per_peer.get(c.address, 0), -c.since))
        # Its slot is free now, not when its task has seen the connection end. Aborted,
        # not cancelled: its read or write ends in the ConnectionError or
        # IncompleteReadError every closed connection ends in, where a cancelled task
        # made 3.11's asyncio log "Exception in callback" (it asks a cancelled
        # client_connected_cb task for its exception).
        self._forget(victim)
        victim.writer.transport.abort()
        return True

    def _forget(self, conn: _Connection) -> None:
        if self._open.pop(conn.task, None) is None:
            return  # already closed for room
        if (left := self._per_peer.pop(conn.address) - 1) > 0:
            self._per_peer[conn.address] = left

    def _log_error(self, what: str) -> None:
        """Logs the exception being handled at ERROR with its traceback (the formatter
        escapes it), at most once per ERROR_LOG_EVERY_S."""
        if (due := self._errors.due(None, time.monotonic())) is None:
            return
        log.error(
            "status page: %s (%d such error(s) since the last such line); this is a bug "
            "in rendezvousd: report it with this traceback",
            what,
            due.skipped + 1,
            exc_info=True,
        )

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        conn: _Connection,
    ) -> None:
        first = True
        while True:
            try:
                # The first request gets the request timeout; a kept-alive connection may
                # idle longer before its next one.
                head = await asyncio.wait_for(
                    reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S if first else IDLE_S
                )
                first = False
                request, keep = await asyncio.wait_for(
                    _parse(head, reader, peer), REQUEST_TIMEOUT_S
                )
            except asyncio.LimitOverrunError:
                await _send(writer, Response(431, b"request head too large\n"), close=True)
                return
            except HttpError as exc:
                await _send(writer, Response(exc.status, f"{exc}\n".encode()), close=True)
                return
            conn.busy = True
            try:
                response = await self._handler(request)
            except Exception:
                # The client's method and path, cut (a path is up to 16 KiB).
                what = f"{shortened(request.method, 16)} {shortened(request.path)}"
                self._log_error(f"{what} from {peer} failed")
                response = Response(500, b"internal error; see the daemon's log\n")
            finally:
                conn.busy = False
            await _send(writer, response, close=not keep, head_only=request.method == "HEAD")
            conn.since = time.monotonic()
            if not keep:
                return


async def _parse(head: bytes, reader: asyncio.StreamReader, peer: str) -> tuple[Request, bool]:
    try:
        text = head.decode("latin-1")
        line, *header_lines = text[:-4].split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise HttpError(400, "malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(400, "only HTTP/1.0 and HTTP/1.1 are served")
    headers: dict[str, str] = {}
    for h in header_lines:
        name, colon, value = h.partition(":")
        if not colon:
            raise HttpError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise HttpError(411, "send a Content-Length body, not a chunked one")
    text = headers.get("content-length", "0")
    try:
        # 1*DIGIT: int() alone took "-1" (answered 413), "+5" and "1_0" as lengths.
        if not (text.isascii() and text.isdigit()):
            raise ValueError(text)
        length = int(text)
    except ValueError:
        raise HttpError(400, "Content-Length is not a number") from None
    if length > MAX_BODY_BYTES:
        raise HttpError(413, f"request bodies are limited to {MAX_BODY_BYTES} bytes")
    body = await reader.readexactly(length) if length else b""
    try:
        # urlsplit checks a bracketed host ("http://[x/"): ValueError, not a request.
        url = urlsplit(target)
        path, query = unquote(url.path), dict(parse_qsl(url.query))
    except ValueError:
        raise HttpError(400, "malformed request target") from None
    connection = headers.get("connection", "").lower()
    keep = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return Request(method, path, query, headers, body, peer), keep


async def _send(
    writer: asyncio.StreamWriter, r: Response, *, close: bool, head_only: bool = False
) -> None:
    lines = [
        f"HTTP/1.1 {r.status} {HTTPStatus(r.status).phrase}",
        f"Content-Type: {r.content_type}",
        f"Content-Length: {len(r.body)}",
        "X-Content-Type-Options: nosniff",
        *(f"{k}: {v}" for k, v in r.headers),
    ]
    if close:
        lines.append("Connection: close")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    if not head_only:
        writer.write(r.body)
    await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1)
