"""The metrics/status HTTP port as docs/operations.md words it, with its numbers written
out (a test reading the daemon's constants follows them wherever they go): "at most 64
connections at once, 16 of them from one client address (the next is answered 503 and
closed)", a full table closing for a newcomer the longest-waiting connection of the
address holding the most, sessions "1,024 in all, 64 per token scope ... a full table
ending a job token's session before an admin's", and "a wrong token is logged at
WARNING"."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit

from rendezvousd.server.scope import derive_job_token
from tests.support import DaemonProcess, wait_for

CONNECTIONS = 64  # "at most 64 connections at once"
PER_ADDRESS = 16  # "16 of them from one client address"
SESSIONS = 1_024  # "1,024 in all"
PER_SCOPE = 64  # "64 per token scope"


def _address(d: DaemonProcess) -> tuple[str, int]:
    url = urlsplit(d.metrics_url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def _get(conn: http.client.HTTPConnection, path: str, **headers: str) -> int:
    """A request on ``conn``, kept alive: its status (the body read whole)."""
    conn.request("GET", path, headers=headers)
    answer = conn.getresponse()
    answer.read()
    assert answer.status != 200 or not answer.will_close, "the connection was not kept"
    return answer.status


def _served_from(source: str, d: DaemonProcess) -> http.client.HTTPConnection:
    """A connection from ``source`` (loopback has every 127/8 address), held open after
    a scrape on it was answered 200."""
    host, port = _address(d)
    conn = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    assert _get(conn, "/metrics") == 200, f"a connection from {source} was not served"
    return conn


def _refused_from(source: str, d: DaemonProcess) -> None:
    """A connection from ``source`` is answered 503 and closed, before any request."""
    with socket.create_connection(_address(d), timeout=10, source_address=(source, 0)) as conn:
        answer = b""
        while chunk := conn.recv(4096):  # until the daemon closes it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]


def _closed(conn: http.client.HTTPConnection) -> bool:
    """Whether the daemon closed kept-alive ``conn`` (its next request finds it gone)."""
    try:
        _get(conn, "/metrics")
    except (ConnectionError, http.client.HTTPException):
        return True
    return False


def test_64_connections_are_served_at_once_16_from_one_address_and_the_next_refused(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A daemon of its own: connections other tests closed are counted until the
    daemon has seen them end."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    sources = [f"127.0.0.{10 + i}" for i in range(CONNECTIONS // PER_ADDRESS)]
    with ExitStack() as stack:

        def hold(source: str) -> http.client.HTTPConnection:
            conn = _served_from(source, d)
            stack.callback(conn.close)
            return conn

        held = [hold(sources[0]) for _ in range(PER_ADDRESS)]
        _refused_from(sources[0], d)  # its 17th, with 48 connections free
        held += [hold(source) for source in sources[1:] for _ in range(PER_ADDRESS)]
        assert len(held) == CONNECTIONS
        # The refusal took no slot: each held connection is served again.
        assert all(_get(conn, "/metrics") == 200 for conn in held)


def test_a_full_table_closes_a_connection_of_the_address_holding_most_for_a_newcomer(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """h121 F3: 4 addresses x 16 connections, each kept alive by one request, filled
    the table, and every scrape from elsewhere was answered 503 for as long as they
    went on. "When the table is full, a newcomer is served and the connection that has
    waited longest on its client, of the address holding the most, is closed": the
    operator's connection, older than all of theirs but its address's only one, stays."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    with ExitStack() as stack:
        operator = _served_from("127.0.0.1", d)
        stack.callback(operator.close)
        attackers: list[http.client.HTTPConnection] = []
        for a in range(2, 2 + CONNECTIONS // PER_ADDRESS):
            for _ in range(PER_ADDRESS):
                attackers.append(_served_from(f"127.0.0.{a}", d))
                stack.callback(attackers[-1].close)
        # 65 served: the 64th attacker's made room by closing 127.0.0.2's oldest.
        scrape = _served_from("127.0.0.1", d)  # and this one, 127.0.0.3's oldest
        stack.callback(scrape.close)
        assert _get(operator, "/metrics") == 200, "the operator's connection was closed"
        assert _closed(attackers[0]) and _closed(attackers[PER_ADDRESS])
        assert not _closed(attackers[1]) and not _closed(attackers[PER_ADDRESS + 1])


@contextmanager
def _login_connection(d: DaemonProcess) -> Iterator[Callable[[str], str]]:
    """``login(token)`` -> the session cookie, over one kept-alive connection."""
    conn = http.client.HTTPConnection(*_address(d), timeout=10)

    def login(token: str) -> str:
        conn.request(
            "POST",
            "/login",
            body=f"token={token}".encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 303, answer.status
        return (answer.getheader("Set-Cookie") or "").split(";", 1)[0]

    try:
        yield login
    finally:
        conn.close()


def _api_status(d: DaemonProcess, cookie: str) -> int:
    conn = http.client.HTTPConnection(*_address(d), timeout=10)
    try:
        conn.request("GET", "/api/jobs", headers={"Cookie": cookie})
        answer = conn.getresponse()
        answer.read()
        return answer.status
    finally:
        conn.close()


def test_a_full_session_table_ends_job_tokens_sessions_not_the_admins(
    daemon: DaemonProcess,
) -> None:
    """17 jobs' tokens, each at its scope's 64, fill the 1,024-session table past full
    (1,089 with the admin's, the oldest): the 65 sessions ended are job tokens', the
    oldest first, and the admin stays logged in."""
    jobs = SESSIONS // PER_SCOPE + 1
    with _login_connection(daemon) as login:
        admin = login(daemon.token)
        cookies = [
            [login(derive_job_token(daemon.token, f"table-job-{j}")) for _ in range(PER_SCOPE)]
            for j in range(jobs)
        ]
    assert _api_status(daemon, admin) == 200, "a job token's logins logged the admin out"
    # Full: the oldest job sessions went (job 0's all, job 1's first), the rest stand.
    assert _api_status(daemon, cookies[0][0]) == 401
    assert _api_status(daemon, cookies[0][-1]) == 401
    assert _api_status(daemon, cookies[1][0]) == 401
    assert _api_status(daemon, cookies[1][1]) == 200
    assert _api_status(daemon, cookies[-1][-1]) == 200


def test_a_wrong_token_at_the_login_is_logged_at_warning(daemon: DaemonProcess) -> None:
    wrong = "not-the-token-" + "x" * 30
    conn = http.client.HTTPConnection(*_address(daemon), timeout=10)
    try:
        conn.request(
            "POST",
            "/login",
            body=f"token={wrong}".encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 401
    finally:
        conn.close()

    def said() -> list[str]:
        return [line for line in daemon.log().splitlines() if "with an invalid token" in line]

    wait_for("the refused login logged", lambda: bool(said()))
    (line,) = said()
    assert " WARNING " in line, line
    assert "status page: refused a login with an invalid token from 127.0.0.1:" in line
    assert wrong not in daemon.log()
