"""``rendezvousd health`` and ``rendezvousd status``: look at a running daemon.

``health`` mirrors grpc_health_probe's exit codes: 0 serving, 1 bad arguments,
2 connection failure or timeout, 3 RPC failure, 4 not serving; ``status`` uses the
first four.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common import grid
from rendezvousd.common.escape import escape, shortened
from rendezvousd.common.log_time import utc_stamp
from rendezvousd.common.model import MemberState
from rendezvousd.common.secret_files import missing_token
from rendezvousd.common.validation import LONGEST_WAIT_S
from rendezvousd.common.version import UNKNOWN
from rendezvousd.errors import ConfigError

if TYPE_CHECKING:
    from rendezvousd.client.connection import TlsConfig

EXIT_SERVING, EXIT_ARGS, EXIT_CONNECTION, EXIT_RPC, EXIT_NOT_SERVING = 0, 1, 2, 3, 4
#: The least a failed check's look at the endpoint gets, past --timeout if need be.
LOOK_FLOOR_S = 0.1
DEFAULT_ENDPOINT = "127.0.0.1:29420"


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS files the flags name, checked first: half a client key pair (which
    aborts the whole process inside gRPC's core) or a pair without a CA, as
    ``TlsConfig.from_paths`` refuses them, and an unreadable file, which would be a
    traceback. Raises ConfigError naming the flag."""
    from rendezvousd.client.connection import TlsConfig
    from rendezvousd.client.errors import InvalidRequest

    try:
        tls = TlsConfig.from_paths(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    except InvalidRequest as exc:
        raise ConfigError(_flag_words(str(exc))) from None
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                       ("--tls-key", args.tls_key)):  # fmt: skip
        try:
            if path is not None:
                Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {flag} {path}: {exc.strerror}") from None
    if tls is not None:
        try:
            tls.credentials()  # a file that is no PEM, a key others can read...
        except InvalidRequest as exc:
            # In this command's flags: a swapped pair's advice names TlsConfig's keywords.
            raise ConfigError(_flag_words(str(exc))) from None
    return tls


def _channel(args: argparse.Namespace, tls: TlsConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(args.endpoint)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(args.endpoint, tls.credentials(), options=options)


def _check_endpoint(endpoint: str) -> None:
    """Refuses --endpoint as ``status`` (the SDK) does: handed to gRPC, '' or 'host'
    alone became a channel gRPC could not create, its core's log lines and exit 3 (an
    RPC failure) for what is a bad argument."""
    from rendezvousd.client._session import check_endpoint
    from rendezvousd.client.errors import InvalidRequest

    try:
        check_endpoint(endpoint)
    except InvalidRequest as exc:
        raise ConfigError(str(exc)) from None


def _health(args: argparse.Namespace) -> int:
    try:
        tls = _tls(args)
        _check_endpoint(args.endpoint)
    except ConfigError as exc:
        print(f"rendezvousd health: {exc}", file=sys.stderr)
        return EXIT_ARGS
    started = time.monotonic()
    with _channel(args, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                from rendezvousd.client.connection import (
                    CLOCK_SIGNS,
                    HANDSHAKE_SIGNS,
                    daemon_certificate_dates,
                    dial_problem,
                    speaks_tls,
                )

                # What the look below may take: the rest of --timeout (a silent port's
                # fixed 2 s sniff after it made --timeout 2 take 4.3 s), a floor so that
                # a refusing port still answers it.
                left = max(LOOK_FLOOR_S, args.timeout - (time.monotonic() - started))
                # gRPC's reason for the last failed connection attempt.
                reason = str(exc.details() or "").rsplit("last error: ", 1)[-1]
                lowered = reason.lower()
                if args.tls_ca is None and speaks_tls(args.endpoint, left):
                    # A TLS daemon just drops a plaintext connection: gRPC cannot say why.
                    why = f"the daemon at {args.endpoint} speaks TLS: pass --tls-ca"
                elif tls is not None and any(sign in lowered for sign in CLOCK_SIGNS):
                    # Refused for its dates, by this host's clock: no flag would help.
                    why = (
                        f"the TLS handshake with {args.endpoint} failed ({reason}): "
                        f"{daemon_certificate_dates(args.endpoint, left)}"
                    )
                elif tls is not None and any(
                    sign in lowered for sign in (*HANDSHAKE_SIGNS, "socket closed")
                ):
                    # The daemon is up, but refused this client's TLS ("socket closed":
                    # how a --tls-client-ca daemon turns away a client certificate).
                    why = (
                        f"the TLS handshake with {args.endpoint} failed ({reason}): check "
                        "--tls-ca (the CA that signed the daemon's certificate) and "
                        "--tls-server-name; a daemon with --tls-client-ca also needs "
                        "--tls-cert/--tls-key signed by that CA"
                        if speaks_tls(args.endpoint, left)
                        else f"the daemon at {args.endpoint} does not speak TLS: drop --tls-ca"
                    )
                else:
                    # As `status` and the SDK say it: what a plain connect finds there.
                    seen = dial_problem(args.endpoint, left)
                    why = f"cannot reach {args.endpoint}: {code.name}" + (
                        f"; {seen}" if seen else ""
                    )
                print(f"rendezvousd health: {why}", file=sys.stderr)
                return EXIT_CONNECTION
            detail = exc.details() or ""
            if code is grpc.StatusCode.NOT_FOUND and not detail:  # grpcio-health says no more
                detail = (
                    f"the daemon has no service {args.service!r}: check '' (the whole "
                    f"daemon) or {pb.DESCRIPTOR.services_by_name['Rendezvous'].full_name!r}"
                )
            print(f"rendezvousd health: Check failed: {code.name}: {detail}", file=sys.stderr)
            return EXIT_RPC
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"rendezvousd health: {args.endpoint} is {status}", file=sys.stderr)
        return EXIT_NOT_SERVING
    print(f"rendezvousd health: {args.endpoint} is SERVING")
    return EXIT_SERVING


def _status(args: argparse.Namespace) -> int:
    from rendezvousd.client import (
        AuthenticationError,
        DaemonUnavailable,
        InvalidRequest,
        NotFound,
        RendezvousClient,
        RendezvousError,
    )

    try:
        tls = _tls(args)
        if (missing := missing_token(args.token_file, os.environ)) is not None:
            raise ConfigError(missing)
    except ConfigError as exc:
        print(f"rendezvousd status: {exc}", file=sys.stderr)
        return EXIT_ARGS
    # Watching redraws a terminal; piped or redirected, it is the one snapshot a
    # script can read.
    watch = args.watch is not None and sys.stdout.isatty()
    from rendezvousd.client.warnings_said import say_client_warnings

    say_client_warnings(
        lambda said: print(f"rendezvousd status: {_flag_words(said)}", file=sys.stderr)
    )
    try:
        with RendezvousClient(
            args.endpoint,
            token_file=args.token_file,
            tls=tls,
            connect_timeout=args.timeout,
            call_timeout=args.timeout,
            # "Seconds before giving up": the SDK's retry waited them twice.
            retry_attempts=0,
        ) as client:

            def snapshot() -> str:
                if args.job:
                    text = render_job(client.get_job(args.job))
                else:
                    listed = client.list_jobs()
                    # Finished jobs are counted from the list alone: a daemon holds up
                    # to max_jobs of them until --job-ttl-s, and a GetJob each made
                    # 1,000 held ones 250 KB and seconds of output burying the live few.
                    shown = listed if args.all else [s for s in listed if not _finished(s)]
                    jobs = []
                    for summary in shown:
                        try:
                            jobs.append(client.get_job(summary.job_id))
                        except NotFound:  # forgotten since it was listed: no longer a job
                            continue
                    text = render(jobs, "" if args.all else finished_line(listed))
                head = daemon_line(args.endpoint, client.daemon_version())
                return f"{head}{storage_line(client.storage_failing_since())}\n{text}"

            if not watch:
                print(snapshot())
                return 0
            while True:
                try:
                    text = snapshot()
                except RendezvousError as exc:  # the daemon restarting: keep watching
                    text = f"rendezvousd status: {escape(str(exc))}"
                stamp = utc_stamp()  # as the daemon's log lines are: UTC, marked
                head = f"{args.endpoint}  every {args.watch:g} s  {stamp}  (Ctrl-C to stop)"
                # Home and clear, then the frame: one write, so it never flickers half-drawn.
                sys.stdout.write(f"\x1b[H\x1b[2J{head}\n\n{text}\n")
                sys.stdout.flush()
                time.sleep(args.watch)
    except RendezvousError as exc:
        # health's exit codes, so a script tells a daemon down from a refused call.
        said = _flag_words(str(exc))
        # The SDK's TLS refusals (a handshake that failed, a plaintext/TLS mismatch)
        # are UNAVAILABLE: the connection failed, as health says (a token's is not).
        tls_refused = isinstance(exc, AuthenticationError) and exc.code == "UNAVAILABLE"
        if isinstance(exc, DaemonUnavailable) or tls_refused:
            print(f"rendezvousd status: {said}", file=sys.stderr)
            return EXIT_CONNECTION
        print(f"rendezvousd status: {said}", file=sys.stderr)
        return EXIT_ARGS if isinstance(exc, InvalidRequest) else EXIT_RPC
    except KeyboardInterrupt:
        return 0


def _flag_words(said: str) -> str:
    """The SDK's message, escaped, in this command's flags."""
    for sdk_words, flag_words in _FLAG_WORDS:
        said = said.replace(sdk_words, flag_words)
    return escape(said)


#: The SDK's words for its keywords and variables, as this command's flags: it reads
#: only its flags (--timeout sets connect_timeout).
#: Literal, as the SDK's constants (``TLS_WORDS``, ``TOKEN_ADVICE``) say them: this
#: module imports the client only when it runs (tests/client/test_error_words.py pins
#: that they agree).
_FLAG_WORDS = (
    ("pass tls=TlsConfig(ca=PATH)", "pass --tls-ca"),
    ("connect without TLS (tls=None)", "drop --tls-ca"),
    (
        "Check TlsConfig's ca (it must have signed the daemon's certificate) and server_name",
        "Check --tls-ca (it must have signed the daemon's certificate) and --tls-server-name",
    ),
    ("TlsConfig's cert and key", "--tls-cert and --tls-key"),
    (
        "give the client certificate as TlsConfig's cert and its private key as TlsConfig's key",
        "give the client certificate as --tls-cert and its private key as --tls-key",
    ),
    (
        "(token= / token_file=, or $RENDEZVOUSD_TOKEN_FILE / $RENDEZVOUSD_TOKEN)",
        "(--token-file, or $RENDEZVOUSD_TOKEN_FILE / $RENDEZVOUSD_TOKEN)",
    ),
    # TlsConfig's own checks of the flags' files (``_tls``): "TlsConfig(cert=PATH)
    # without key=: ..." and "TlsConfig.from_paths(cert=PATH) without ca=: ...".
    ("TlsConfig(cert=", "--tls-cert "),
    ("TlsConfig(key=", "--tls-key "),
    ("TlsConfig.from_paths(cert=", "--tls-cert "),
    ("TlsConfig.from_paths(key=", "--tls-key "),
    (") without key=:", " without --tls-key:"),
    (") without cert=:", " without --tls-cert:"),
    (") without ca=:", " without --tls-ca:"),
    ("needs ca=,", "needs --tls-ca,"),
    ("(connect_timeout)", "(--timeout)"),
)


def daemon_line(endpoint: str, version: str) -> str:
    """The header naming which daemon answered: which rendezvousd it runs (its
    ``--version``), unknown from one from before GetJob and ListJobs said it."""
    said = escape(version) if version else f"{UNKNOWN} (a rendezvousd from before 2026-12-07)"
    return f"daemon {escape(endpoint)}: rendezvousd {said}"


def storage_line(since: float | None) -> str:
    """The line under the daemon's while its state storage fails ("" while it takes
    writes): the jobs' rows alone read as all well while every change is refused."""
    if since is None:
        return ""
    return (
        f"\nNOT_SERVING: state storage failing since {utc_stamp(since)}: changes are "
        "refused until it takes writes again; see the daemon's log"
    )


#: The states of a job whose generation is over: held until --job-ttl-s (or until a new
#: job takes its max_jobs slot), counted by ``status`` unless --all.
FINISHED = (
    ("ended", pb.JOB_STATE_ENDED),
    ("failed", pb.JOB_STATE_FAILED),
    ("aborted", pb.JOB_STATE_ABORTED),
)


def _finished(summary: Any) -> bool:
    return any(summary.state == state for _, state in FINISHED)


def finished_line(summaries: list[Any]) -> str:
    """The one line counting the finished jobs ``status`` leaves out ("" for none)."""
    counts = [(word, sum(s.state == state for s in summaries)) for word, state in FINISHED]
    total = sum(n for _, n in counts)
    if not total:
        return ""
    by_state = ", ".join(f"{word} {n}" for word, n in counts if n)
    jobs = "job" if total == 1 else "jobs"
    return f"+ {total} finished {jobs} held ({by_state}): --all lists them"


#: The members ``status JOB`` names whose loss waits for storage (a node's ranks each).
PENDING_NAMED = 8


def render(jobs: list[Any], finished: str = "") -> str:
    """The status table (``finished``: the line counting the finished jobs left out);
    every client-provided text in it is escaped."""
    lines = [f"{'JOB':<24} {'STATE':<8} {'GEN':>4} {'WORLD':>6} {'PRESENT':>8} {'AGE':>8}"]
    for job in jobs:
        s = job.summary
        state = pb.JobState.Name(s.state).removeprefix("JOB_STATE_")
        lines.append(
            f"{escape(s.job_id):<24} {state:<8} {s.generation:>4} {s.world_size:>6} "
            f"{s.members_present:>8} {grid.age(s.state_age_ms / 1000):>8}"
        )
        for m in job.members:
            mstate = pb.MemberState.Name(m.state).removeprefix("MEMBER_STATE_")
            watched = _watched(s.state, m.state)
            if m.state == pb.MEMBER_STATE_ACTIVE and not watched:
                # Its generation is over: it is not expected to beat, and "ACTIVE" alone
                # read as a live member whose heartbeat was late.
                mstate = f"{mstate} (job {state.lower()})"
            elif m.loss_pending:
                # Dead, its loss kept until storage takes writes: "ACTIVE" alone, its
                # heartbeat stopped, read as a live member about to be blamed.
                mstate = f"{mstate} (loss pending: {escape(m.loss_pending)})"
            lines.append(
                f"    rank {m.member.rank:>5}  node {m.member.node_rank:>4}  local "
                f"{m.member.local_rank:>3}  {escape(m.member.host):<20} {mstate:<8} "
                f"heartbeat {grid.age(m.heartbeat_age_ms / 1000) if watched else '-'}"
            )
        lines += _ending(job)
    if not jobs:
        lines.append("(no forming or running jobs)" if finished else "(no jobs)")
    if finished:
        lines.append(finished)
    return "\n".join(lines)


def _watched(job_state: int, member_state: int) -> bool:
    """Whether a member's heartbeat age means anything (the daemon's
    ``liveness.watched``): an active member of a running job. Any other shows "-",
    not the 0 GetJob gives it (a rank lost for its silence read "heartbeat 0.0s")."""
    return job_state == pb.JOB_STATE_RUNNING and member_state == pb.MEMBER_STATE_ACTIVE


def render_job(job: Any) -> str:
    """One job: its line of the table, then the node x local-rank grid the status
    page draws (the same letters), its losses and its abort reason."""
    late_s = job.heartbeat_timeout_ms / 1000 * grid.LATE_SHARE
    table = render([pb.GetJobResponse(summary=job.summary)]).splitlines()
    facts = []
    job_step = grid.job_step(
        ((MemberState(m.state), m.step if m.HasField("step") else None) for m in job.members),
        ended=job.summary.state == pb.JOB_STATE_ENDED,
    )
    if job_step is not None:
        facts.append(f"step {job_step}")
    if job.HasField("restarts_used"):
        facts.append(f"restarts {job.restarts_used} used, {job.restarts_left} left")
    if job.nodes_waiting:
        standing = f" ({job.standbys} standing by)" if job.standbys else ""
        facts.append(f"{job.nodes_waiting} node(s) waiting to join{standing}")
    if job.seats_kept:
        facts.append(
            f"{job.seats_kept} seat(s) kept for nodes re-joining after the failure "
            f"({job.seats_kept_ms / 1000:.0f} s more)"
        )
    if job.HasField("previous_run_ended_ms"):
        facts.append(
            f"a new run of this job id: its previous run ended "
            f"{grid.age(job.previous_run_ended_ms / 1000)} ago (every member left)"
        )
    lines = [*table, *(["    " + " · ".join(facts)] if facts else [])]
    lines += _forming(job)
    lines += _losses_pending(job)
    per_node = max(1, job.summary.topology.gpus_per_node)
    rows = grid.node_rows(
        (
            (
                m.member.node_rank,
                m.member.local_rank,
                m.member.host,
                MemberState(m.state),
                m.heartbeat_age_ms / 1000,
                m.step if m.HasField("step") else None,
                m.member.address,
            )
            for m in job.members
        ),
        per_node,
        late_s,
    )
    for n in job.joining:
        # A forming node's row, where its node rank is known: its seats joining.
        if n.HasField("node_rank") and n.node_rank not in rows:
            rows[n.node_rank] = grid.NodeRow(n.host, [grid.SEAT[MemberState.JOINING]] * per_node)
    # The address each node advertised (the one its peers dial): a multi-homed host's
    # wrong pick was visible only in GetJob (h145 F5).
    width = max([15, *(len(escape(r.address)) for r in rows.values())])
    lines.append(
        f"    {'NODE':>5}  {'HOST':<20} {'ADDRESS':<{width}} {'RANKS':<{max(5, per_node)}}  "
        "HEARTBEAT   STEP"
    )
    beating = {m.member.node_rank for m in job.members if _watched(job.summary.state, m.state)}
    for node, row in sorted(rows.items()):
        step = "-" if row.step is None else str(row.step)
        age = f"{row.age_s:>8.1f}s" if node in beating else f"{'-':>9}"
        lines.append(
            f"    {node:>5}  {escape(row.host):<20} {escape(row.address) or '-':<{width}} "
            f"{''.join(row.seats):<{max(5, per_node)}}  "
            f"{age} {step:>6}"
        )
    lines += [f"    ({grid.LEGEND})", *_ending(job)]
    return "\n".join(lines)


def _losses_pending(job: Any) -> list[str]:
    """The members lost while storage fails, kept ACTIVE (the grid draws them so) until
    the daemon can write their loss (MemberStatus.loss_pending)."""
    pending = [m for m in job.members if m.loss_pending]
    if not pending:
        return []
    named = ", ".join(
        f"rank {m.member.rank} on {escape(m.member.host)} ({escape(m.loss_pending)})"
        for m in pending[:PENDING_NAMED]
    )
    more = f" and {len(pending) - PENDING_NAMED} more" if len(pending) > PENDING_NAMED else ""
    return [f"    lost, pending until storage takes writes: {named}{more}"]


def _forming(job: Any) -> list[str]:
    """A forming node generation's nodes joined so far and what it still lacks (empty
    for another job, and from a daemon from before GetJob's joining)."""
    if job.summary.state != pb.JOB_STATE_FORMING:
        return []
    if not job.min_nodes:
        # A per-rank job (or a daemon from before min_nodes): its joining ranks are its
        # members, drawn below; what is missing is the ranks none of them holds.
        ranks = grid.missing_ranks(job.summary.world_size, (m.member.rank for m in job.members))
        return [f"    missing: {ranks}"] if ranks and job.members else []
    joined = grid.joined_nodes(
        (n.node_rank if n.HasField("node_rank") else None, n.host, n.joined_ms_ago / 1000)
        for n in job.joining
    )
    lines = [f"    joined: {joined or 'no node yet'}"]
    missing = grid.missing_nodes(job.missing_node_ranks, job.nodes_needed, job.min_nodes)
    if missing:
        lines.append(f"    missing: {missing}")
    return lines


def _ending(job: Any) -> list[str]:
    """A job's losses, the conflict that failed its forming generation and its abort
    reason, escaped, as both views end with them."""
    lines = [
        f"    lost rank {f.rank} on {escape(f.host)}: {shortened(f.cause)}" for f in job.failed
    ]
    # (A FAILED generation with no loss read as nothing at all: a joiner of another
    # version or topology failed it, said only to the joiners and in the daemon's log.)
    lines += [f"    refused: {escape(job.conflict)}"] if job.conflict else []
    lines += [f"    aborted: {escape(job.abort_reason)}"] if job.abort_reason else []
    # An earlier generation's failure (this one's is said above): after the job
    # re-formed, or while it forms again, nothing said why it had restarted.
    last = job.last_failure if job.HasField("last_failure") else None
    if last is not None and last.generation != job.summary.generation:
        lines.append(
            f"    last failure: generation {last.generation}, {grid.age(last.age_ms / 1000)} ago "
            f"({job.failures} in all): {shortened(last.cause)}"
        )
    return lines


def _seconds(least: float) -> Callable[[str], float]:
    """An argparse type: seconds from ``least`` to ``LONGEST_WAIT_S``. gRPC takes a negative,
    NaN or huge timeout as already passed ("cannot reach" a daemon that is up), and
    time.sleep refuses them (a traceback); --watch 0 redrew without a pause, hammering
    the daemon."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not least <= value <= LONGEST_WAIT_S:  # NaN fails too
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds from {least:g} to {LONGEST_WAIT_S:.0f}"
            )
        return value

    return parse


def add_probe_commands(sub: Any) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--endpoint",
            default=DEFAULT_ENDPOINT,
            help="HOST:PORT of the daemon (default: %(default)s)",
        )
        p.add_argument(
            "--timeout",
            type=_seconds(0.001),
            default=5.0,
            help="seconds before giving up (default: %(default)g)",
        )
        p.add_argument("--tls-ca", default=None, help="PEM CA that signed the daemon's certificate")
        p.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS)")
        p.add_argument("--tls-key", default=None, help="PEM client key (mTLS)")
        p.add_argument(
            "--tls-server-name",
            default=None,
            help="name to verify in the daemon's certificate (e.g. when probing 127.0.0.1)",
        )

    health = sub.add_parser("health", help="check grpc.health.v1 (exit 0 when SERVING)")
    common(health)
    health.add_argument("--service", default="", help="service name to check ('' = whole daemon)")
    health.set_defaults(func=_health)

    status = sub.add_parser(
        "status",
        help="table of forming and running jobs (--all: finished ones too), members, hosts "
        "and heartbeat ages",
    )
    common(status)
    status.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="token file (default $RENDEZVOUSD_TOKEN_FILE, or the token in $RENDEZVOUSD_TOKEN)",
    )
    status.add_argument(
        "--watch",
        type=_seconds(0.1),
        nargs="?",
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 1) on a terminal; piped, print one snapshot. "
        "Give JOB before it (JOB --watch): right after it, JOB is read as SECONDS",
    )
    status.add_argument(
        "--all",
        action="store_true",
        help="list finished (ended, failed, aborted) jobs too; without it they are "
        "counted in one line. A JOB named is shown whatever its state",
    )
    status.add_argument("job", nargs="?", help="only this job")
    status.set_defaults(func=_status)
