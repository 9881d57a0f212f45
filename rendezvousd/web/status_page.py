"""The status page and its JSON (issue 22), served beside /metrics.

Who may see what: the admin token sees every job, a job token only its job, and
no token only the login page (``/metrics`` stays open, as before, for Prometheus).
A browser presents its token once, through the login form; the token is never
kept in the browser: the cookie is a random session id that the daemon maps to
the token's scope, HttpOnly and SameSite=Strict, ending after ``SESSION_S``, or once its
token would be refused (a job token expired or its job ended; either kind removed from
the token file by a reload).
Scripts send ``Authorization: Bearer TOKEN`` instead.

What is shown comes from ``JobView`` (never the id, tokens or instance ids) and
the generation ``Timeline``; client-provided text (hosts, causes) is escaped here
and set as text, never markup, by the page's script.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rendezvousd.common.escape import escape, quoted, shortened
from rendezvousd.common.grid import (
    LATE_SHARE,
    SEAT,
    NodeRow,
    missing_nodes,
    missing_ranks,
    node_rows,
)
from rendezvousd.common.log_throttle import LogThrottle
from rendezvousd.common.model import JobState, JobView, MemberState, Transition
from rendezvousd.common.version import installed_version
from rendezvousd.errors import RendezvousFault
from rendezvousd.server.auth import REFUSED_HOSTS, REFUSED_LOG_S, bearer_token
from rendezvousd.server.metrics import HTTP_METHOD, Metrics, build_labels
from rendezvousd.server.scope import Scope
from rendezvousd.state.machine import RendezvousState
from rendezvousd.web.http_server import Request, Response
from rendezvousd.web.timeline import Timeline

log = logging.getLogger("rendezvousd.status")

COOKIE = "rdzv_session"
SESSION_S = 12 * 3600
MAX_SESSIONS = 1024
# One scope's sessions (the admin token's, or one job token's): past it, its own oldest
# goes. Without it a job token's holder evicted every admin session with 1,024 logins.
MAX_SESSIONS_PER_SCOPE = 64
# One job's JSON lists at most this many nodes per page (the grid asks for the rest).
NODE_PAGE = 1024
# How many of a forming generation's joined nodes the job's JSON lists (its count is whole).
JOINED_SHOWN = 256
# A job's view is built once for the page's two requests of one update (the overview,
# then the job): at 4,096 members a view costs ~30 ms of the daemon's loop. A state
# change (a Transition) drops it at once; heartbeat ages may be this much old.
VIEW_TTL_S = 0.5
# How often the page polls: every POLL_S, slower past POLL_MEMBERS members in all (a
# second per 1,024 members), so that one open page costs the daemon's loop about
# the same few percent at 8,192 members as at 2,048 (benchmarks/status_page.py).
POLL_S = 2.0
POLL_MEMBERS = 2048
# A conflict's words on the job view: every one it has (it names at most 8 hosts,
# versions of at most 128 bytes), bounded anyway.
CONFLICT_CHARS = 2000
# Steps per second are measured over this much of the job's recent step samples.
RATE_WINDOW_S = 30.0
# The overview lists every live job, but only a page of the finished ones the daemon
# holds (until --job-ttl-s): ~1,000 of them made /api/jobs 400 KB, each poll, the few
# live jobs buried among them (h147 F6). This many by default, the newest first; a
# request may ask for up to FINISHED_PAGE_MAX (``finished_limit``, ``finished_offset``).
FINISHED_PAGE = 20
FINISHED_PAGE_MAX = 1024

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
_SECURITY = [
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
]


@dataclass(frozen=True)
class Session:
    scope: Scope
    expires: float
    # Who logged in, for the log of what they did: the address it came from and a
    # name for the session that is not the cookie itself.
    peer: str
    tag: str
    # The token, checked again on every request as a Bearer one is: a job token may
    # expire, or its job end, long before the session does, and either kind may be
    # removed from the token file by a reload (SIGHUP), which ends its sessions.
    token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Caller:
    scope: Scope
    who: str


class StatusPage:
    def __init__(
        self,
        state: RendezvousState,
        metrics: Metrics,
        timeline: Timeline,
        scope_of: Callable[[str], Scope | None],
        abort: Callable[[str, str], Awaitable[int]],
        *,
        secure_cookie: bool,
        storage_failing_since: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.state = state
        self._storage_failing_since = storage_failing_since
        self.metrics = metrics
        self.timeline = timeline
        self._scope_of = scope_of
        self._abort = abort
        self._secure = secure_cookie
        self._sessions: dict[str, Session] = {}
        self._files: dict[str, bytes] = {}
        self._views_made: dict[str, tuple[float, JobView]] = {}
        # (when, the job's step) per job, one per view made: the step rate's samples.
        self._steps: dict[str, deque[tuple[float, int]]] = {}
        # Per caller's host, as the gRPC port's refusals: anyone who reaches the port
        # can try tokens, through the login form or as a Bearer header.
        # Logins and Bearer requests apart: a script's stale Bearer token must not hide
        # the line of a person mistyping the login.
        self._refused: LogThrottle[tuple[bool, str]] = LogThrottle(REFUSED_LOG_S, REFUSED_HOSTS)
        metrics.transition_listeners.append(self._changed)

    # -- routing -------------------------------------------------------------

    async def handle(self, r: Request) -> Response:
        if r.path == "/metrics" and r.method in ("GET", "HEAD"):
            return Response(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        if r.path in ("/login", "/logout") and r.method == "POST":
            if _cross_site(r):
                # Another site's form could log a browser into the poster's session (or
                # out of its own); SameSite keeps the cookie from such a post, not this.
                return Response(403, b"a login or logout from another site is refused\n")
            return self._login(r) if r.path == "/login" else self._logout(r)
        caller = self._caller(r)
        if r.path in _STATIC and r.method in ("GET", "HEAD"):
            if r.path == "/" and caller is None:
                return self._file("login.html", "text/html; charset=utf-8", 200)
            return self._file(*_STATIC[r.path], 200)
        if not r.path.startswith("/api/"):
            return Response(404, b"no such page; the status page is at /\n")
        if caller is None:
            return _json(401, {"error": "log in with the admin token or the job's token"})
        if r.path == "/api/jobs" and r.method == "GET":
            try:
                offset = max(0, int(r.query.get("finished_offset", "0")))
                limit = int(r.query.get("finished_limit", str(FINISHED_PAGE)))
            except ValueError:
                return _json(400, {"error": "finished_offset and finished_limit are numbers"})
            limit = min(FINISHED_PAGE_MAX, max(0, limit))
            return _json(200, self.overview(caller.scope, offset, limit))
        parts = r.path.split("/")
        if len(parts) == 4 and r.method == "GET":
            return self._job(caller.scope, parts[3], r.query)
        if len(parts) == 5 and parts[4] == "abort" and r.method == "POST":
            return await self._abort_job(caller, parts[3], r)
        return _json(404, {"error": f"no such API path {quoted(r.path)}"})

    def _file(self, name: str, content_type: str, status: int) -> Response:
        body = self._files.get(name)
        if body is None:
            body = resources.files("rendezvousd.web").joinpath("status_static", name).read_bytes()
            self._files[name] = body
        return Response(status, body, content_type, list(_SECURITY))

    # -- who is asking --------------------------------------------------------

    def _caller(self, r: Request) -> Caller | None:
        auth = r.headers.get("authorization", "")
        if auth:
            token = bearer_token(auth)
            scope = self._scope_of(token) if token is not None else None
            if scope is None:
                self._bad_token(r, "a Bearer request to " + quoted(r.path), login=False)
                return None
            return Caller(scope, f"{scope} bearer token from {r.peer}")
        sid = _cookie(r.headers.get("cookie", ""))
        session = self._sessions.get(sid) if sid else None
        if session is None:
            return None
        if session.expires < time.monotonic() or (
            session.token is not None and self._scope_of(session.token) is None
        ):
            del self._sessions[sid]
            return None
        return Caller(session.scope, f"{session.scope} session {session.tag} from {session.peer}")

    def _login(self, r: Request) -> Response:
        form = dict(parse_qsl(r.body.decode("utf-8", "replace")))
        token = form.get("token", "").strip()
        scope = self._scope_of(token)
        if scope is None:
            self._bad_token(r, "a login", login=True)
            return self._file("login.html", "text/html; charset=utf-8", 401)
        now = time.monotonic()
        self._make_room(scope, now)
        sid = secrets.token_urlsafe(32)
        tag = hashlib.sha256(sid.encode()).hexdigest()[:8]
        self._sessions[sid] = Session(scope, now + SESSION_S, r.peer, tag, token)
        log.info("status page: %s logged in from %s (session %s)", escape(str(scope)), r.peer, tag)
        cookie = f"{COOKIE}={sid}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_S}"
        if self._secure:
            cookie += "; Secure"
        return Response(303, b"", headers=[("Location", "/"), ("Set-Cookie", cookie)])

    def _bad_token(self, r: Request, what: str, *, login: bool) -> None:
        """A token this daemon does not accept, on this port: counted with the gRPC
        port's (``auth_refused{method="http"}``), and logged at most once a minute per
        caller's host (a guess over the metrics port left no trace); never the token."""
        self.metrics.count_auth_refused(HTTP_METHOD)
        host = r.peer.rpartition(":")[0] or r.peer
        if (due := self._refused.due((login, host), time.monotonic())) is None:
            return
        more = (
            f" ({due.skipped} more refused from {host} in the {due.since_s:.0f} s since the "
            "last line, not logged)"
            if due.skipped
            else ""
        )
        log.warning(
            "status page: refused %s with an invalid token from %s (401: not a token this "
            "daemon accepts); use the admin token or a job's token (rendezvousd token "
            "--job JOB)%s",
            what,
            r.peer,
            more,
        )

    def _make_room(self, scope: Scope, now: float) -> None:
        """Room for a session of ``scope``: sessions are bounded, each scope's too, and
        a full table gives up a job token's oldest session before an admin's."""
        mine = [k for k, s in self._sessions.items() if s.scope == scope]
        if len(mine) >= MAX_SESSIONS_PER_SCOPE:
            del self._sessions[mine[0]]  # in login order: the oldest
        if len(self._sessions) >= MAX_SESSIONS:
            self._sessions = {k: s for k, s in self._sessions.items() if s.expires > now}
        if len(self._sessions) >= MAX_SESSIONS:
            jobs = (k for k, s in self._sessions.items() if not s.scope.admin)
            del self._sessions[next(jobs, next(iter(self._sessions)))]

    def _logout(self, r: Request) -> Response:
        sid = _cookie(r.headers.get("cookie", ""))
        if sid:
            self._sessions.pop(sid, None)
        cookie = f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
        return Response(303, b"", headers=[("Location", "/"), ("Set-Cookie", cookie)])

    # -- what they see ----------------------------------------------------------

    def _changed(self, t: Transition) -> None:
        self._views_made.pop(t.job_id, None)

    def _view(self, job_id: str) -> JobView:
        """The job's view (raises NOT_FOUND), reused for ``VIEW_TTL_S``."""
        now = time.monotonic()
        made = self._views_made.get(job_id)
        if made is not None and now - made[0] < VIEW_TTL_S:
            return made[1]
        if len(self._views_made) > 2 * len(self.state.jobs) + 16:
            # Jobs forgotten without a listener hearing it (a restore): bounded anyway.
            self._views_made.clear()
        view = self.state.view(job_id, now)
        self._views_made[job_id] = (now, view)
        self._sample_step(job_id, now, view)
        return view

    def _sample_step(self, job_id: str, now: float, v: JobView) -> None:
        step = v.step
        samples = self._steps.get(job_id)
        if step is None or (samples and step < samples[-1][1]):
            # No step yet, or training went back (resumed from an older state): the
            # rate starts again from here.
            self._steps.pop(job_id, None)
            if step is None:
                return
            samples = None
        if samples is None:
            if len(self._steps) > 2 * len(self.state.jobs) + 16:
                self._steps.clear()  # forgotten jobs: bounded like the views
            samples = self._steps[job_id] = deque()
        samples.append((now, step))
        while samples and now - samples[0][0] > RATE_WINDOW_S:
            samples.popleft()

    def _rate(self, job_id: str) -> float | None:
        samples = self._steps.get(job_id)
        if not samples or samples[-1][0] - samples[0][0] < 1.0:
            return None
        (t0, s0), (t1, s1) = samples[0], samples[-1]
        return round((s1 - s0) / (t1 - t0), 2)

    def _views(self, ids: list[str]) -> list[JobView]:
        views = []
        for job_id in ids:
            try:
                views.append(self._view(job_id))
            except RendezvousFault:
                continue
        return views

    def overview(
        self, scope: Scope, finished_offset: int = 0, finished_limit: int = FINISHED_PAGE
    ) -> dict[str, Any]:
        """Every live job the scope sees, by id, then a page of its finished ones, the
        most recently finished first, and how many finished ones there are by state:
        sorted from the jobs' records, so that only the jobs shown cost a view."""
        jobs = self.state.jobs
        ids = sorted(jobs) if scope.admin else [j for j in [scope.job or ""] if j in jobs]
        live = [j for j in ids if jobs[j].state not in _FINISHED]
        finished = sorted(
            (j for j in ids if jobs[j].state in _FINISHED), key=lambda j: -jobs[j].state_since
        )
        page = finished[finished_offset : finished_offset + finished_limit]
        views = self._views(live + page)
        by_state = {s.name: 0 for s in _FINISHED}
        for j in finished:
            by_state[jobs[j].state.name] += 1
        members = sum(len(v.members) for v in views)
        return {
            "admin": scope.admin,
            "scope": str(scope),
            "now": time.time(),
            "heartbeat_timeout_s": self.state.timing.heartbeat_timeout_s,
            "poll_s": POLL_S if members <= POLL_MEMBERS else members / 1024,
            # Which daemon answers (rendezvousd_build_info's labels): shown in the
            # page's header, so a page open across an upgrade says which one it reads.
            "daemon_version": installed_version(),
            "build": build_labels(),
            # The page's banner: the jobs' rows alone read as all well while every
            # change is refused (None while storage takes writes).
            "storage_failing_since": self._storage_failing_since(),
            # The live jobs (forming, running) first, then the page of finished ones.
            "jobs": [self._summary(v) for v in views],
            "finished": {
                "total": len(finished),
                "by_state": by_state,
                "offset": finished_offset,
                "limit": finished_limit,
            },
        }

    def _summary(self, v: JobView) -> dict[str, Any]:
        # The nodes of the members present, by the view's one rule (none once the
        # generation failed, was aborted or ended: a survivor still attached is no node
        # of the job's), which ``members_present`` already applied.
        present = v.members if v.members_present else ()
        nodes = len({m.info.node_rank for m in present if m.state in _PRESENT})
        if v.state is JobState.FORMING and v.min_nodes:
            # A forming node generation has no member rows yet: its members present are
            # its joined nodes' ranks (``members_present``), gpus_per_node each.
            nodes = v.members_present // max(1, v.gpus_per_node)
        return {
            "job_id": escape(v.job_id),
            "state": v.state.name,
            "generation": v.generation,
            "world_size": v.world_size,
            "members_present": v.members_present,
            "num_nodes": v.num_nodes,
            "gpus_per_node": v.gpus_per_node,
            "nodes_present": nodes,
            "nodes_waiting": v.nodes_waiting,
            "standbys": v.standbys,
            "seats_kept": v.seats_kept,
            "seats_kept_s": round(v.seats_kept_s, 1),
            "previous_run_ended_s": (
                None if v.previous_run_ended_s is None else round(v.previous_run_ended_s, 1)
            ),
            "state_age_s": round(v.state_age_s, 1),
            # The job's, kept with it (after it re-formed, and across a restart).
            "last_failure": _last_failure(v),
            "failures": v.failures,
            "abort_reason": shortened(v.abort_reason),
            "heartbeat_age_max_s": round(
                max((m.heartbeat_age_s for m in v.members if m.state in _PRESENT), default=0.0), 1
            ),
            # Progress the node agents' heartbeats carry (None where none reported).
            "step": v.step,
            "steps_per_s": self._rate(v.job_id),
            "restarts_used": v.restarts_used,
            "restarts_left": v.restarts_left,
        }

    def _job(self, scope: Scope, job_id: str, query: dict[str, str]) -> Response:
        if not scope.admin and scope.job != job_id:
            # The same answer as for a job that does not exist: a job token learns
            # nothing about other jobs, not even that they exist.
            return _json(404, {"error": "no such job"})
        try:
            view = self._view(job_id)
        except RendezvousFault:
            return _json(404, {"error": "no such job"})
        try:
            offset = max(0, int(query.get("node_offset", "0")))
            limit = min(NODE_PAGE, max(1, int(query.get("node_limit", str(NODE_PAGE)))))
        except ValueError:
            return _json(400, {"error": "node_offset and node_limit are numbers"})
        return _json(200, self.job(view, offset, limit))

    def job(self, v: JobView, offset: int = 0, limit: int = NODE_PAGE) -> dict[str, Any]:
        late = self.state.timing.heartbeat_timeout_s * LATE_SHARE
        # One pass over the members: at 4,096 members this runs on every poll, on the
        # daemon's loop.
        rows = node_rows(
            (
                (
                    m.info.node_rank,
                    m.info.local_rank,
                    m.info.host,
                    m.state,
                    m.heartbeat_age_s,
                    m.step,
                    m.info.address,
                )
                for m in v.members
            ),
            max(1, v.gpus_per_node),
            late,
            range(offset, offset + limit),
        )
        for n in v.joining:
            # A forming node's row, where its node rank is known: its seats joining.
            rank = n.node_rank
            if rank is not None and rank not in rows and offset <= rank < offset + limit:
                rows[rank] = NodeRow(n.host, [SEAT[MemberState.JOINING]] * max(1, v.gpus_per_node))
        now = time.monotonic()
        return {
            **self._summary(v),
            "late_after_s": late,
            "nodes": {
                "offset": offset,
                "limit": limit,
                "total": v.num_nodes,
                "rows": [
                    {
                        "node": n,
                        "host": escape(row.host),
                        # Advertised: the address peers dial ("" for a joining node).
                        "address": escape(row.address),
                        "seats": "".join(row.seats),
                        # A row of joining seats has no heartbeat yet: none, not "0.0 s"
                        # (``rendezvousd status`` shows "-" there too).
                        "age": (
                            None
                            if all(c == SEAT[MemberState.JOINING] for c in row.seats)
                            else round(row.age_s, 1)
                        ),
                        "step": row.step,
                    }
                    for n, row in sorted(rows.items())
                ],
            },
            "failed": [
                {
                    "rank": f.rank,
                    "host": escape(f.host),
                    "node_rank": f.node_rank,
                    "local_rank": f.local_rank,
                    "cause": shortened(f.cause),
                    "age_s": round(now - f.lost_at, 1) if f.lost_at is not None else None,
                }
                for f in v.failed[:64]
            ],
            "failed_total": len(v.failed),
            # A forming node generation: its nodes joined so far (the first
            # JOINED_SHOWN, in arrival order) and what it still lacks.
            "forming": {
                "joined": [
                    {
                        "node": n.node_rank,
                        "host": escape(n.host),
                        "instance_tag": n.instance_tag,
                        "joined_s": round(n.joined_s, 1),
                    }
                    for n in v.joining[:JOINED_SHOWN]
                ],
                "joined_total": len(v.joining),
                "missing_node_ranks": (
                    None if v.missing_node_ranks is None else list(v.missing_node_ranks[:1024])
                ),
                "nodes_needed": v.nodes_needed,
                "min_nodes": v.min_nodes,
                "missing": missing_nodes(v.missing_node_ranks or (), v.nodes_needed, v.min_nodes),
            }
            if v.min_nodes and v.state is JobState.FORMING
            else _forming_ranks(v),
            # Why the generation failed while it formed with no member lost (a joiner's
            # topology or version), as its joiners were told; kept over a restart. Whole
            # (its hosts and versions are what to fix), within a bound all the same.
            "conflict": shortened(v.conflict, CONFLICT_CHARS),
            "timeline": [
                {
                    "at": e.at,
                    "generation": e.generation,
                    "from": e.old,
                    "to": e.new,
                    "detail": e.detail,
                    "change": e.change,
                }
                for e in self.timeline.of(v.job_id)
            ],
        }

    async def _abort_job(self, caller: Caller, job_id: str, r: Request) -> Response:
        if not caller.scope.admin:
            return _json(403, {"error": "only the admin token may abort a job from this page"})
        # A cross-site form cannot set this header (SameSite already keeps the
        # cookie from such a request; this also covers Bearer callers' browsers).
        if r.headers.get("x-requested-with") != "rendezvousd":
            return _json(403, {"error": "send the X-Requested-With: rendezvousd header"})
        try:
            reason = str(json.loads(r.body or b"{}").get("reason") or "")[:200]
        except (ValueError, AttributeError):
            return _json(400, {"error": 'the body is JSON: {"reason": "..."}'})
        reason = f"aborted from the status page by {caller.who}" + (f": {reason}" if reason else "")
        log.warning("status page: job %s aborted by %s", escape(job_id), escape(caller.who))
        try:
            generation = await self._abort(job_id, reason)
        except RendezvousFault as fault:
            status = 404 if fault.code.name == "NOT_FOUND" else 409
            return _json(status, {"error": fault.message})
        return _json(200, {"job_id": escape(job_id), "generation": generation})


_PRESENT = (MemberState.JOINING, MemberState.ACTIVE)
# A job whose generation is over, held until --job-ttl-s: counted, and listed a page at
# a time (in this order in ``by_state``).
_FINISHED = (JobState.ENDED, JobState.FAILED, JobState.ABORTED)


def _forming_ranks(v: JobView) -> dict[str, Any] | None:
    """A forming per-rank generation's ranks missing (its joining ranks are its
    members, in the grid): the page's ``forming`` without nodes."""
    if v.state is not JobState.FORMING or v.min_nodes or not v.members:
        return None
    missing = missing_ranks(v.world_size, (m.info.rank for m in v.members))
    return {"joined": [], "joined_total": 0, "missing": missing} if missing else None


def _last_failure(v: JobView) -> str:
    """The job's last failure, named by its generation when it is an earlier one's."""
    last = v.last_failure
    if last is None:
        return ""
    cause = shortened(last.cause)
    return cause if last.generation == v.generation else f"generation {last.generation}: {cause}"


def _cross_site(r: Request) -> bool:
    """A browser's request made by another site's page: its ``Sec-Fetch-Site`` says so,
    or, from a browser without it, its ``Origin`` is not this server's ``Host``. A
    client that sends neither (curl, a script with the token) is no browser's."""
    site = r.headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = r.headers.get("origin")
    if origin is None:
        return False
    return urlsplit(origin).netloc != r.headers.get("host", "")


def _cookie(header: str) -> str:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return ""


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(
        status,
        json.dumps(body, separators=(",", ":")).encode(),
        "application/json",
        [("Cache-Control", "no-store")],
    )
