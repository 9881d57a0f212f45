"""The status page's HTTP side, on a live daemon: who sees what, the login cookie,
the JSON the page draws from, the Abort button, and the server's bounds."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

from rendezvousd.client import JobEnded, RendezvousClient
from rendezvousd.server.scope import derive_job_token
from rendezvousd.web.http_server import MAX_BODY_BYTES, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER
from tests.support import DaemonProcess, Pki, node_with_a_standby, scrape, wait_for

UID = b"\x5a" * 128


def _address(d: DaemonProcess) -> tuple[str, int]:
    url = urlsplit(d.metrics_url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def request(
    d: DaemonProcess,
    method: str,
    path: str,
    *,
    token: str | None = None,
    cookie: str | None = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    host, port = _address(d)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    if cookie is not None:
        sent["Cookie"] = cookie
    try:
        conn.request(method, path, body=body, headers=sent)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def login(d: DaemonProcess, token: str) -> tuple[int, dict[str, str]]:
    """The login form posted with ``token``: its status and headers."""
    status, headers, _ = request(
        d,
        "POST",
        "/login",
        body=f"token={token}".encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    return status, headers


def api(d: DaemonProcess, path: str, **kw: Any) -> Any:
    status, _, body = request(d, "GET", path, **kw)
    assert status == 200, (status, body)
    return json.loads(body)


@contextmanager
def running_job(d: DaemonProcess, job_id: str) -> Iterator[RendezvousClient]:
    """A one-rank job, RUNNING while the block lasts."""
    with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, unique_id=UID, timeout=20)
        c.start_heartbeat(0.2)
        yield c


def test_no_token_gets_only_the_login_page(daemon: DaemonProcess, job_id: str) -> None:
    with running_job(daemon, job_id):
        status, headers, page = request(daemon, "GET", "/")
        assert status == 200
        assert b'action="/login"' in page and job_id.encode() not in page
        assert "script-src 'self'" in headers["content-security-policy"]
        for path in ("/api/jobs", f"/api/jobs/{job_id}"):
            status, _, body = request(daemon, "GET", path)
            assert status == 401, path
            assert job_id.encode() not in body
        status, _, body = request(daemon, "GET", "/api/jobs", token="not-a-valid-token-at-all")
        assert status == 401 and job_id.encode() not in body
        # Prometheus still scrapes without a token, as before.
        assert request(daemon, "GET", "/metrics")[0] == 200


def test_the_json_shows_the_job_and_none_of_its_secrets(daemon: DaemonProcess, job_id: str) -> None:
    with running_job(daemon, job_id) as c:
        wait_for(
            "the job to run",
            lambda: any(
                j["job_id"] == job_id and j["state"] == "RUNNING"
                for j in api(daemon, "/api/jobs", token=daemon.token)["jobs"]
            ),
        )
        status, _, raw = request(daemon, "GET", f"/api/jobs/{job_id}", token=daemon.token)
        assert status == 200
        job = json.loads(raw)
        assert job["generation"] == 1 and job["world_size"] == 1
        assert job["nodes"]["total"] == 1
        [row] = job["nodes"]["rows"]
        assert row["seats"] == "A" and row["node"] == 0
        assert [e["to"] for e in job["timeline"]] == ["FORMING", "RUNNING"]
        # The worker's instance id (what fences its rank): the SDK's own record of it.
        instance_id = c._s.instance_id
        assert instance_id
        secrets = [UID, UID.hex().encode(), daemon.token.encode(), instance_id.encode()]
        for secret in secrets:
            assert secret not in raw
        overview = request(daemon, "GET", "/api/jobs", token=daemon.token)[2]
        assert all(s not in overview for s in secrets)


def test_a_job_token_sees_only_its_job(daemon: DaemonProcess, job_id: str) -> None:
    other = job_id + "-other"
    with running_job(daemon, job_id), running_job(daemon, other):
        mine = derive_job_token(daemon.token, job_id)
        theirs = derive_job_token(daemon.token, other)
        seen = api(daemon, "/api/jobs", token=mine)
        assert [j["job_id"] for j in seen["jobs"]] == [job_id]
        assert seen["admin"] is False
        assert request(daemon, "GET", f"/api/jobs/{other}", token=mine)[0] == 404
        assert api(daemon, f"/api/jobs/{job_id}", token=mine)["job_id"] == job_id
        # A token for a job that does not exist sees nothing at all.
        ghost = derive_job_token(daemon.token, job_id + "-ghost")
        assert api(daemon, "/api/jobs", token=ghost)["jobs"] == []
        assert [j["job_id"] for j in api(daemon, "/api/jobs", token=theirs)["jobs"]] == [other]


def test_login_sets_a_session_cookie_that_is_not_the_token(
    daemon: DaemonProcess, job_id: str
) -> None:
    with running_job(daemon, job_id):
        status, headers = login(daemon, daemon.token)
        assert status == 303 and headers["location"] == "/"
        cookie = headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Max-Age=" in cookie
        assert daemon.token not in cookie
        session = cookie.split(";", 1)[0]
        status, _, page = request(daemon, "GET", "/", cookie=session)
        assert status == 200 and b"/static/app.js" in page
        assert job_id in [j["job_id"] for j in api(daemon, "/api/jobs", cookie=session)["jobs"]]
        status, _, _ = request(daemon, "POST", "/logout", cookie=session)
        assert status == 303
        assert request(daemon, "GET", "/api/jobs", cookie=session)[0] == 401
        status, headers, page = request(
            daemon, "POST", "/login", body=b"token=wrong-token-but-long-enough"
        )
        assert status == 401 and "set-cookie" not in headers and b'action="/login"' in page
        wait_for("the refused login in the log", lambda: "with an invalid token" in daemon.log())
        assert "wrong-token-but-long-enough" not in daemon.log()


def test_a_job_tokens_session_ends_when_the_token_expires(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A session is checked as its token is: an expired job token (or one minted before
    its job last ended) no longer sees the job, however long ago its browser logged in."""
    with running_job(daemon, job_id):
        token = derive_job_token(daemon.token, job_id, int(time.time()) + 2)
        status, headers = login(daemon, token)
        assert status == 303
        session = headers["set-cookie"].split(";", 1)[0]
        assert [j["job_id"] for j in api(daemon, "/api/jobs", cookie=session)["jobs"]] == [job_id]
        wait_for(
            "the token to expire",
            lambda: request(daemon, "GET", "/api/jobs", token=token)[0] == 401,
        )
        status, _, body = request(daemon, "GET", "/api/jobs", cookie=session)
        assert status == 401 and job_id.encode() not in body
        assert request(daemon, "GET", f"/api/jobs/{job_id}", cookie=session)[0] == 401


def test_abort_needs_the_admin_token_and_is_logged_with_who(
    daemon: DaemonProcess, job_id: str
) -> None:
    with running_job(daemon, job_id):
        path = f"/api/jobs/{job_id}/abort"
        marker = {"X-Requested-With": "rendezvousd"}
        job_token = derive_job_token(daemon.token, job_id)
        assert request(daemon, "POST", path, token=job_token, headers=marker)[0] == 403
        # Without the page's header (what a cross-site form would send): refused.
        assert request(daemon, "POST", path, token=daemon.token)[0] == 403
        assert api(daemon, f"/api/jobs/{job_id}", token=daemon.token)["state"] == "RUNNING"
        status, _, body = request(daemon, "POST", path, token=daemon.token, headers=marker)
        assert status == 200, body
        job = api(daemon, f"/api/jobs/{job_id}", token=daemon.token)
        assert job["state"] == "ABORTED"
        assert (
            "aborted from the status page by admin bearer token from 127.0.0.1"
            in (job["abort_reason"])
        )
        assert [e["to"] for e in job["timeline"]][-1] == "ABORTED"
        wait_for("the abort in the log", lambda: f"job {job_id} aborted by admin" in daemon.log())
        assert daemon.token not in daemon.log()


def test_the_grid_is_paged_by_node(daemon: DaemonProcess, job_id: str) -> None:
    with running_job(daemon, job_id):
        page = api(daemon, f"/api/jobs/{job_id}?node_offset=1&node_limit=5", token=daemon.token)
        assert page["nodes"]["rows"] == [] and page["nodes"]["offset"] == 1
        status, _, _ = request(
            daemon, "GET", f"/api/jobs/{job_id}?node_offset=x", token=daemon.token
        )
        assert status == 400


def _connect_from(source: str, host: str, port: int) -> socket.socket:
    return socket.create_connection((host, port), timeout=10, source_address=(source, 0))


def _refused_from(source: str, host: str, port: int) -> bool:
    with _connect_from(source, host, port) as extra:
        return extra.recv(64).startswith(b"HTTP/1.1 503")


def _closed(conn: socket.socket) -> bool:
    """Whether the server closed (or aborted) ``conn``, within the socket's timeout."""
    try:
        return conn.recv(64) == b""
    except ConnectionResetError:
        return True


def test_connections_are_bounded_and_heads_are_limited(daemon: DaemonProcess) -> None:
    """Four client addresses (loopback has them all), each at its own cap, fill the
    table with connections that send nothing: a scrape from a fifth is served all the
    same (h121 F3: it was answered 503 for as long as the four went on), the table
    closing one of theirs to make room."""
    host, port = _address(daemon)
    status, _, _ = request(daemon, "GET", "/", headers={"X-Big": "x" * 20_000})
    assert status == 431
    sources = [f"127.0.0.{i}" for i in range(2, MAX_CONNECTIONS // MAX_CONNECTIONS_PER_PEER + 2)]
    with ExitStack() as stack:
        idle = [
            stack.enter_context(_connect_from(source, host, port))
            for source in sources
            for _ in range(MAX_CONNECTIONS_PER_PEER)
        ]
        assert len(idle) == MAX_CONNECTIONS
        for _ in range(3):  # each scrape a connection of its own, from 127.0.0.1
            assert request(daemon, "GET", "/metrics")[0] == 200
        # The room was made from theirs: the first connections they opened were closed.
        assert _closed(idle[0]), "the longest-waiting connection was not closed"


def test_one_address_cannot_hold_every_connection(daemon: DaemonProcess) -> None:
    """A client that opened connections and sent nothing held all 64 from one address
    (each for its 10 s request timeout, and opened again), and every scrape from
    elsewhere was refused."""
    host, port = _address(daemon)
    with ExitStack() as stack:
        for _ in range(MAX_CONNECTIONS_PER_PEER):
            stack.enter_context(_connect_from("127.0.0.5", host, port))
        wait_for("its next connection refused", lambda: _refused_from("127.0.0.5", host, port))
        with _connect_from("127.0.0.6", host, port) as other:
            other.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert other.recv(64).startswith(b"HTTP/1.1 200"), "another address is served"


def _raw(d: DaemonProcess, data: bytes) -> tuple[int, bytes]:
    """``data`` sent as is on a connection of its own: the status and the whole answer,
    read until the server closes the connection (it must: every refusal closes)."""
    with socket.create_connection(_address(d), timeout=10) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    line = answer.split(b"\r\n", 1)[0]
    assert line.startswith(b"HTTP/1.1 "), answer
    return int(line.split(b" ")[1]), answer


def test_requests_it_does_not_serve_are_refused_and_the_port_serves_on(
    daemon: DaemonProcess,
) -> None:
    """What the metrics port refuses before any page sees it, each answered with why
    and the connection closed; the next scrape is served. Bodies are Content-Length
    only, up to MAX_BODY_BYTES (operations.md: "bodies up to 16 KiB")."""
    head = "POST /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{}\r\n\r\n"
    refused = [
        (b"GARBAGE\r\n\r\n", 400, b"malformed request line"),
        (b"GET /metrics HTTP/1.1 extra\r\n\r\n", 400, b"malformed request line"),
        (b"GET /metrics HTTP/2.0\r\n\r\n", 400, b"only HTTP/1.0 and HTTP/1.1 are served"),
        (
            b"GET /metrics HTTP/1.1\r\nno colon\r\nConnection: close\r\n\r\n",
            400,
            b"malformed header line",
        ),
        # No chunked bodies (the chunk itself is not sent: the refusal comes first).
        (head.format("Transfer-Encoding: chunked").encode(), 411, b"not a chunked one"),
        (
            head.format("Transfer-Encoding: chunked\r\nContent-Length: 5").encode(),
            411,
            b"send a Content-Length body",
        ),
        (head.format("Content-Length: five").encode(), 400, b"Content-Length is not a number"),
        (head.format("Content-Length: -1").encode(), 400, b"Content-Length is not a number"),
        (head.format("Content-Length: 1_0").encode(), 400, b"Content-Length is not a number"),
        (head.format("Content-Length: +5").encode(), 400, b"Content-Length is not a number"),
        (
            head.format(f"Content-Length: {MAX_BODY_BYTES + 1}").encode(),
            413,
            f"request bodies are limited to {MAX_BODY_BYTES} bytes".encode(),
        ),
    ]
    for data, status, why in refused:
        got, answer = _raw(daemon, data)
        assert got == status and why in answer.split(b"\r\n\r\n", 1)[1], (data, answer)
        assert b"\r\nConnection: close\r\n" in answer, answer
        assert request(daemon, "GET", "/metrics")[0] == 200, data
    # A body of exactly the limit is read whole: the login form's token at its end counts.
    form = f"token={daemon.token}".encode()
    body = b"pad=" + b"x" * (MAX_BODY_BYTES - len(form) - 5) + b"&" + form
    assert len(body) == MAX_BODY_BYTES
    status, answer = _raw(daemon, head.format(f"Content-Length: {len(body)}").encode() + body)
    assert status == 303 and b"Set-Cookie: rdzv_session=" in answer, answer[:200]


def test_a_malformed_request_target_is_answered_400_and_logs_no_traceback(
    daemon: DaemonProcess,
) -> None:
    """A bracketed host urlsplit cannot parse made a ValueError nothing caught: the
    connection closed unanswered and asyncio logged "Unhandled exception in
    client_connected_cb" at ERROR with a traceback (the client's text in it), once per
    request: 4 MB of log in 3 s from one client (h121 F2)."""
    targets = [b"http://[x/", b"http://[::1\x1b[31mEVIL]/", b"//[/metrics", b"/metrics?a=[::1"]
    for target in targets[:3]:
        for _ in range(5):
            got, answer = _raw(daemon, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert got == 400 and b"malformed request target" in answer, (target, answer)
    # A bracket in the query is no host: served as the path it names.
    assert _raw(daemon, b"GET " + targets[3] + b" HTTP/1.1\r\nConnection: close\r\n\r\n")[0] == 200
    assert request(daemon, "GET", "/metrics")[0] == 200
    log = daemon.log()
    for said in ("Unhandled exception", "Traceback", "EVIL"):
        assert said not in log, f"{said!r} in the daemon's log:\n{log[-3000:]}"


def test_under_tls_the_page_is_https_and_its_cookie_secure(
    pki: Pki, start_daemon: Callable[..., DaemonProcess]
) -> None:
    d = start_daemon(*pki.serve_args(), "--metrics-listen", "127.0.0.1:0")
    host, port = _address(d)
    context = ssl.create_default_context(cafile=str(pki.ca))
    conn = http.client.HTTPSConnection(host, port, timeout=10, context=context)
    try:
        conn.request(
            "POST",
            "/login",
            body=f"token={d.token}",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        r = conn.getresponse()
        r.read()
        assert r.status == 303
        assert "; Secure" in (r.getheader("Set-Cookie") or "")
    finally:
        conn.close()


def test_a_standby_node_is_counted_apart(daemon: DaemonProcess, job_id: str) -> None:
    """A standby parked on a full node job: the JSON counts it as waiting and as a
    standby, which the page says apart ("standing by for a lost node's slot")."""
    with node_with_a_standby(daemon, job_id) as (node, outcome, standby):
        wait_for(
            "the standby in the JSON",
            lambda: api(daemon, f"/api/jobs/{job_id}", token=daemon.token)["standbys"] == 1,
        )
        job = api(daemon, f"/api/jobs/{job_id}", token=daemon.token)
        assert job["nodes_waiting"] == 1 and job["state"] == "RUNNING"
        node.leave()  # the job ends: the standby is told so and its join returns
        standby.join(20)
        assert len(outcome) == 1 and isinstance(outcome[0], JobEnded), outcome


def _post_login(d: DaemonProcess, token: str, headers: dict[str, str]) -> tuple[int, str]:
    status, got, _ = request(
        d,
        "POST",
        "/login",
        body=f"token={token}".encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
    )
    return status, got.get("set-cookie", "")


def test_a_login_or_logout_posted_by_another_site_is_refused(daemon: DaemonProcess) -> None:
    """Another site's page could post the login form with its own token (logging the
    browser into the poster's session) or post a logout: SameSite keeps the cookie
    from such a post, not the post itself."""
    host = "{}:{}".format(*_address(daemon))
    for headers in (
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
    ):
        status, cookie = _post_login(daemon, daemon.token, headers)
        assert status == 403 and not cookie, headers
        assert request(daemon, "POST", "/logout", headers=headers)[0] == 403, headers
    # The page's own form (a browser's same-origin post), and a client that is no browser.
    for headers in ({"Sec-Fetch-Site": "same-origin"}, {"Origin": f"http://{host}"}, {}):
        status, cookie = _post_login(daemon, daemon.token, headers)
        assert status == 303 and cookie.startswith("rdzv_session="), headers


def test_a_job_tokens_logins_cannot_end_an_admins_session(daemon: DaemonProcess) -> None:
    """Sessions are bounded (1,024): the oldest went first, so one job token's holder
    logged every admin out with 1,024 logins. Each scope now holds at most 64, its
    own oldest going first, and a full table gives up a job's session, not an admin's."""
    status, cookie = _post_login(daemon, daemon.token, {})
    admin = cookie.split(";", 1)[0]
    job = derive_job_token(daemon.token, "sessions-job", None)
    sessions = []
    for _ in range(1_100):
        status, cookie = _post_login(daemon, job, {})
        assert status == 303
        sessions.append(cookie.split(";", 1)[0])
    assert request(daemon, "GET", "/api/jobs", cookie=admin)[0] == 200
    assert request(daemon, "GET", "/api/jobs", cookie=sessions[-1])[0] == 200
    assert request(daemon, "GET", "/api/jobs", cookie=sessions[-64])[0] == 200
    assert request(daemon, "GET", "/api/jobs", cookie=sessions[-65])[0] == 401


def test_an_unknown_api_path_is_shown_escaped_once(daemon: DaemonProcess) -> None:
    """The path was escaped, then repr'd: its controls came back doubled ('\\\\x1b')."""
    status, _headers, body = request(daemon, "GET", "/api/nope%1Bx", token=daemon.token)
    assert status == 404
    assert json.loads(body)["error"] == "no such API path '/api/nope\\x1bx'", body


def test_a_per_rank_job_stuck_forming_names_its_missing_ranks(
    daemon: DaemonProcess, job_id: str
) -> None:
    """Ranks 0 and 1 of four joined (a per-rank job): their rows are the grid's, and
    the page's JSON and ``rendezvousd status JOB`` say ranks 2 and 3 are missing (the
    status said only how many were present)."""
    import contextlib
    import subprocess
    import sys
    import threading

    from rendezvousd.client import RendezvousError

    clients = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]

    def join(c: RendezvousClient, local: int) -> None:
        with contextlib.suppress(RendezvousError):  # the abort below ends the wait
            c.join(num_nodes=2, gpus_per_node=2, node_rank=0, local_rank=local, host="pr-a",
                   timeout=30)  # fmt: skip

    joins = [threading.Thread(target=join, args=(c, i), daemon=True) for i, c in enumerate(clients)]
    try:
        for t in joins:
            t.start()

        def both() -> bool:
            with contextlib.suppress(RendezvousError):
                return len(clients[0].get_job().members) == 2
            return False

        wait_for("ranks 0 and 1 to join", both)
        page = api(daemon, f"/api/jobs/{job_id}", token=daemon.token)
        assert page["forming"] == {
            "joined": [],
            "joined_total": 0,
            "missing": "ranks 2, 3 (no worker joined as them)",
        }, page["forming"]
        assert [(r["node"], r["host"], r["seats"], r["age"]) for r in page["nodes"]["rows"]] == [
            (0, "pr-a", "JJ", None)
        ]
        status = subprocess.run(
            [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", daemon.endpoint,
             "--token-file", str(daemon.token_file), job_id],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert "    missing: ranks 2, 3 (no worker joined as them)" in status.stdout, status.stdout
        clients[0].abort("test over")
        for t in joins:
            t.join(20)
    finally:
        for c in clients:
            c.close()


def test_a_forming_node_is_shown_by_a_tag_never_its_instance_id(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A node agent seated in a forming generation is listed (host, node rank, a tag
    of its instance id), but its instance id, the secret its calls name to prove they
    are its own, is in none of GetJob's answer, the page's JSON or ``rendezvousd
    status JOB``: the forming list showed it whole when it came (session 45)."""
    import contextlib
    import hashlib
    import subprocess
    import sys
    import threading

    from rendezvousd.client import RendezvousError

    agent = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)

    def join() -> None:
        with contextlib.suppress(RendezvousError):  # the abort below ends the wait
            agent.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, timeout=30)

    waiting = threading.Thread(target=join, daemon=True)
    try:
        waiting.start()

        def seated() -> bool:
            with contextlib.suppress(RendezvousError):
                return len(agent.get_job().joining) == 1
            return False

        wait_for("the node to be seated", seated)
        instance_id = agent._s.instance_id
        assert instance_id
        tag = hashlib.sha256(instance_id.encode()).hexdigest()[:8]
        answer = agent.get_job()
        assert [n.instance_tag for n in answer.joining] == [tag]
        raw_page = request(daemon, "GET", f"/api/jobs/{job_id}", token=daemon.token)[2]
        [shown] = json.loads(raw_page)["forming"]["joined"]
        assert shown["instance_tag"] == tag, shown
        status = subprocess.run(
            [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", daemon.endpoint,
             "--token-file", str(daemon.token_file), job_id],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        for seen in (answer.SerializeToString(), raw_page, status.stdout.encode()):
            assert instance_id.encode() not in seen
        agent.abort("test over")
        waiting.join(20)
    finally:
        agent.close()


def test_a_forming_node_jobs_joined_node_counts_as_present(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """Node 0 of a 2-node job joined and waiting: ``rendezvousd_members``, GetJob's and
    ListJobs' ``members_present`` and /api/jobs' ``nodes_present`` read 0 while the same
    GetJob listed node 0 joined (a per-rank job counts its joining workers)."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    agent = RendezvousClient(d.endpoint, job_id, token=d.token)
    join = {"min_nodes": 2, "max_nodes": 2, "gpus_per_node": 2, "node_rank": 0, "timeout": 30}

    def node_zero() -> None:
        with contextlib.suppress(Exception):  # closed at the test's end: its wait is cut
            agent.join_node(host="n0", **join)

    waiting = threading.Thread(target=node_zero, daemon=True)
    try:
        waiting.start()
        with RendezvousClient(d.endpoint, job_id, token=d.token) as look:
            wait_for("node 0 joined", lambda: any(j.job_id == job_id for j in look.list_jobs()))
            wait_for("node 0 joined", lambda: len(look.get_job().joining) == 1)
            assert look.get_job().summary.members_present == 2
            (listed,) = [j for j in look.list_jobs() if j.job_id == job_id]
            assert listed.members_present == 2
        wait_for("the gauge's tick", lambda: scrape(d.metrics_url)["rendezvousd_members"] == 2)
        (row,) = api(d, "/api/jobs", token=d.token)["jobs"]
        assert (row["members_present"], row["nodes_present"]) == (2, 1), row
    finally:
        agent.close()
        waiting.join(30)
