"""What the metrics port's server does with an exception no request should cause (a
bug in a page, or in an answer it cannot write): the client gets 500 or a closed
connection, and the daemon's log one ERROR line with its traceback per 10 s, never
asyncio's "Unhandled exception in client_connected_cb" for each (h121 F2: a request
that raised one filled 4 MB of log in 3 s). The server on a real socket, its handler
one that fails as a page with a bug would."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rendezvousd.web.http_server import HttpServer, Request, Response

ROUNDS = 12


async def _ask(port: int, path: str) -> bytes:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def _failing(r: Request) -> Response:
    if r.path == "/raises":
        raise RuntimeError("a page's bug \x1b[31m")
    # A header latin-1 cannot carry: writing the answer's head raises.
    return Response(200, b"ok\n", headers=[("X-Name", "\u20ac")])


async def test_a_failing_page_is_logged_once_per_10_s_and_never_by_asyncio(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    server = HttpServer(_failing)
    port = await server.start("127.0.0.1", 0)
    try:
        for _ in range(ROUNDS):
            assert (await _ask(port, "/raises")).startswith(b"HTTP/1.1 500 ")
            assert await _ask(port, "/unwritable") == b""  # closed: no half a head
        await asyncio.sleep(0.1)  # the connections' tasks done, and their callbacks run
    finally:
        await server.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["rendezvousd.http"], [r.getMessage() for r in errors]
    (record,) = errors
    assert record.exc_info is not None
    assert "GET /raises from 127.0.0.1:" in record.getMessage()
    assert "(1 such error(s) since the last such line)" in record.getMessage()


async def test_stopping_with_connections_open_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """stop() cancelled each open connection's task, and 3.11's asyncio, asking a
    cancelled client_connected_cb task for its exception, logged "Exception in
    callback" with a traceback for each."""
    caplog.set_level(logging.DEBUG)
    server = HttpServer(_failing)
    port = await server.start("127.0.0.1", 0)
    opened = [
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10) for _ in range(3)
    ]
    await asyncio.sleep(0.1)  # accepted: each task waits for its request
    await server.stop()
    for reader, writer in opened:
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the stop
        writer.close()
    await asyncio.sleep(0.1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
