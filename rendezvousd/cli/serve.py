"""``rendezvousd`` command line: serve, health, status, token."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rendezvousd import config as config_mod
from rendezvousd.cli.embedded import EXIT_WITH_PARENT, write_token_file
from rendezvousd.common.address import host_port
from rendezvousd.common.env_names import unknown_names
from rendezvousd.common.escape import EscapingFormatter
from rendezvousd.common.settings import VersionFlag
from rendezvousd.errors import ConfigError, DaemonError, RendezvousFault
from rendezvousd.server.scope import JobToken, derive_job_token

if TYPE_CHECKING:
    # Imported where used: each imports grpc, which must not be loaded before main()
    # chose its log threshold.
    from rendezvousd.daemon import Daemon


def _serve(args: argparse.Namespace) -> int:
    from rendezvousd.server.auth import load_tokens

    # The Namespace also holds non-setting flags (command, func, config); they are skipped.
    cfg = config_mod.load(args.config, overrides=vars(args))
    if args.exit_with_parent:
        _check_parent_pipe()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=cfg.log_level.upper(), handlers=[handler])
    for unread in unknown_names(os.environ):
        logging.getLogger("rendezvousd").warning(unread)
    tokens = load_tokens(cfg.token_file)
    _raise_fd_limit(cfg.max_connections)
    _check_memory_limit(cfg)
    with asyncio.Runner(loop_factory=_loop_factory(cfg.event_loop)) as runner:
        return runner.run(_run(cfg, tokens, exit_with_parent=args.exit_with_parent))


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``--event-loop`` names (None: asyncio's own). Nearly all of a call's
    CPU in the daemon is gRPC's asyncio machinery, not ours (benchmarks/rpc_cost.py);
    uvloop runs the loop under it in C: at a85618b no clear gain per stream call and less
    than half the CPU per heartbeat (docs/operations.md), but a 4,096-rank cold join
    storm finished later on it (docs/benchmarks.md), so it is not the default."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(
            f"event_loop {name!r}: uvloop is not installed ({exc}); install it "
            "(pip install 'rendezvousd[uvloop]') or pass --event-loop asyncio"
        ) from exc
    return uvloop.new_event_loop


def _raise_fd_limit(max_connections: int) -> None:
    from rendezvousd.common.open_files import raise_at_start

    raise_at_start(max_connections)


def _check_memory_limit(cfg: config_mod.DaemonConfig) -> None:
    from rendezvousd.common.memory_limit import warn_at_start

    warn_at_start(cfg.limits())


async def _run(
    cfg: config_mod.DaemonConfig, tokens: list[str], *, exit_with_parent: bool = False
) -> int:
    from rendezvousd.cli.sdnotify import Notifier
    from rendezvousd.daemon import Daemon, serving_gc

    notifier = Notifier.from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(port: int) -> None:
        # Before anyone is told the port: what it freezes is start-up's alone.
        serving_gc()
        host, _ = config_mod.split_listen(cfg.listen)
        shown = cfg.listen if host is None else host_port(host, port)
        # One stable line on stdout: scripts and tests read the bound port here.
        lines = [f"rendezvousd: serving on {shown}"]
        if daemon.metrics_port is not None:
            mhost, _ = config_mod.split_listen(cfg.metrics_listen or "")
            scheme = "https" if cfg.tls_cert is not None else "http"
            where = host_port(mhost or "127.0.0.1", daemon.metrics_port)
            lines.append(f"rendezvousd: metrics on {scheme}://{where}/metrics")
        _say_ready(lines)
        notifier.ready(f"serving on {shown}")

    daemon = Daemon(cfg, tokens, on_ready=ready, on_stopping=notifier.stopping)
    # Before start(): its "serving on" line comes before it returns, and a SIGHUP sent
    # on seeing that line must reload, not end the daemon (SIGHUP's default).
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)
    await daemon.start()
    if exit_with_parent:
        _watch_parent(loop, daemon, stop)
    watchdog = asyncio.create_task(notifier.watchdog_loop()) if notifier.watchdog_interval else None
    await stop.wait()
    logging.getLogger("rendezvousd").info("signal received: draining")
    if watchdog is not None:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
    await daemon.stop()
    return 0


def _say_ready(lines: list[str]) -> None:
    """The ready lines on stdout. A reader that took what it needed and left
    (`serve | head -1`, a script that read the port) closed the pipe: that ends
    nothing here, or the daemon it started would die (exit 141) on the next line."""
    for line in lines:
        try:
            print(line, flush=True)
        except BrokenPipeError:
            # The interpreter's own flush at exit would fail on the pipe too.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            logging.getLogger("rendezvousd").warning(
                "stdout is closed (its reader exited); still serving, stdout now goes to "
                "/dev/null: %s",
                "; ".join(lines),
            )
            return


def _check_parent_pipe() -> None:
    """Refuses, before serving, a stdin that cannot say the parent left: /dev/null or
    a regular file cannot be watched (the event loop refuses them) and would read as
    end of file at once, and a closed stdin has nothing to watch. systemd and nohup
    give /dev/null, so this is a likely mistake, not a theoretical one."""
    what = "closed"
    if sys.stdin is not None:
        try:
            mode = os.fstat(sys.stdin.fileno()).st_mode
        except (OSError, ValueError):
            pass
        else:
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                return
            what = (
                "a terminal"
                if os.isatty(sys.stdin.fileno())
                else _FILE_KINDS.get(stat.S_IFMT(mode), "not a pipe")
            )
    raise ConfigError(
        f"{EXIT_WITH_PARENT}: stdin is {what}; the flag needs stdin to be a pipe (or "
        "socket) from the process that started the daemon, whose end of file says it "
        f"exited. Start the daemon with stdin=PIPE, or drop {EXIT_WITH_PARENT} (a "
        "service manager stops the daemon with SIGTERM)"
    )


_FILE_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFCHR: "a character device (such as /dev/null)",
    stat.S_IFDIR: "a directory",
    stat.S_IFBLK: "a block device",
}


def _watch_parent(loop: asyncio.AbstractEventLoop, daemon: Daemon, stop: asyncio.Event) -> None:
    """Stop when stdin reaches end of file: the kernel closes the parent's end of
    the pipe however the parent dies, SIGKILL included, and unlike
    PR_SET_PDEATHSIG this does not fire when merely the spawning thread ends."""
    fd = sys.stdin.fileno()

    def readable() -> None:
        if os.read(fd, 4096):
            return
        loop.remove_reader(fd)
        daemon.parent_exited()
        tasks.add(loop.create_task(stop_once_heard()))

    async def stop_once_heard() -> None:
        # A survivor stays active until its heartbeat stream hears PEER_FAILED and
        # closes; a call it makes meanwhile must still find the daemon to be told
        # why. The heartbeat timeout bounds the wait for members without a stream.
        deadline = loop.time() + daemon.state.timing.heartbeat_timeout_s
        while daemon.has_active_members() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        stop.set()

    tasks: set[asyncio.Task[None]] = set()
    loop.add_reader(fd, readable)


def _token(args: argparse.Namespace) -> int:
    path: Path = args.path
    if args.valid_for is not None and args.job is None:
        raise ConfigError(
            "--valid-for applies to job tokens (--job J); an admin token ends when it is "
            "removed from the daemon's token file"
        )
    if args.admin_token_file is not None and args.job is None:
        # Without --job the command writes a new random admin token and reads no
        # file: the flag would be silently ignored, and PATH a token the operator
        # did not mean to make.
        raise ConfigError(
            "--admin-token-file applies to job tokens: add --job JOB_ID to derive a "
            "token for that job from it; without --job, `rendezvousd token PATH` writes "
            "a new random admin token and reads no file"
        )
    until = None if args.valid_for is None else int(time.time()) + args.valid_for
    try:
        if args.job is None:
            write_token_file(path, replace=args.force)
        else:
            _write_job_token(path, args.job, args.admin_token_file, until, replace=args.force)
    except FileExistsError:
        print(f"rendezvousd token: {path} exists; pass --force to replace it", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rendezvousd token: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.job is None:
        what = "a new token"
    else:
        ends = "" if until is None else f", valid until {JobToken(args.job, until).expiry_text()}"
        what = f"a token for job {args.job!r}{ends}"
    print(f"rendezvousd token: wrote {what} to {path} (mode 0600)")
    return 0


MAX_VALID_FOR_S = 3650 * 86400


def _duration(text: str) -> int:
    """``--valid-for``: seconds, or a number with s, m, h or d (argparse's type)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    seconds = int(number) * unit if number.isascii() and number.isdigit() else 0
    # Ten years at most: the date stays a plain number of a fixed, small width.
    if not 1 <= seconds <= MAX_VALID_FOR_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration of 1 s to 3650 d: give seconds, or a whole number "
            "with s, m, h or d (90m, 12h, 7d)"
        )
    return seconds


def _write_job_token(
    path: Path, job_id: str, admin_file: Path | None, until: int | None, *, replace: bool
) -> None:
    if admin_file is None:
        raise ConfigError(
            "--job needs --admin-token-file FILE: the daemon's token file the job token "
            "is derived from"
        )
    from rendezvousd.server.auth import read_token_file

    # The first line is the token clients use now (later lines are being rotated out).
    admin = read_token_file(admin_file)[0]
    try:
        token = derive_job_token(admin, job_id, until)
    except RendezvousFault as fault:
        raise ConfigError(fault.message) from None
    write_token_file(path, replace=replace, token=token)


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser, which refuses an argument it does not know itself, with its
    own usage: argparse hands a subcommand's leftovers to the top-level parser, which
    printed ``usage: rendezvousd [-h] [--version] {serve,...}``, naming none of the
    subcommand's flags (``health --bogus``, an audit)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rendezvousd", description=__doc__)
    # An operator upgrading nodes one by one checks what each runs (docs/operations.md,
    # "Upgrading"): every node of a job must run the same version.
    parser.add_argument("--version", action=VersionFlag)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)
    serve = sub.add_parser("serve", help="run the daemon")
    config_mod.add_arguments(serve)
    serve.add_argument(
        EXIT_WITH_PARENT,
        action="store_true",
        help="exit when stdin closes (a pipe from the process that started the daemon, "
        "rank 0 of its jobs, which is then lost)",
    )
    serve.set_defaults(func=_serve)

    token = sub.add_parser(
        "token",
        help="write a new random (admin) token file, or with --job a job-scoped one (mode 0600)",
    )
    token.add_argument("path", type=Path)
    token.add_argument("--force", action="store_true", help="replace an existing file")
    token.add_argument(
        "--job",
        metavar="JOB_ID",
        help="write a token that may only touch this job, derived from --admin-token-file",
    )
    token.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help="the daemon's token file (its first line) to derive the --job token from",
    )
    token.add_argument(
        "--valid-for",
        type=_duration,
        metavar="DURATION",
        help="with --job: the token expires after this long (seconds, or 90m, 12h, 7d); "
        "calls started later are refused. Default: it never expires",
    )
    token.set_defaults(func=_token)

    from rendezvousd.cli.probe import add_probe_commands

    add_probe_commands(sub)
    return parser


#: A command whose reader closed its stdout early: as a shell's SIGPIPE.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] != ["serve"]:
        # A client command's own error names a failed TLS handshake and what to do;
        # gRPC core would add its INFO line per attempt (see the launcher's main). The
        # daemon keeps them: its one sign of a misconfigured client (operations.md).
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        args = build_parser().parse_args(words)
    except SystemExit as exc:
        # health and status keep grpc_health_probe's codes, where 1 is bad arguments and
        # 2 (argparse's own for them) means the daemon could not be reached.
        if exc.code == 2 and words[:1] in (["health"], ["status"]):
            from rendezvousd.cli.probe import EXIT_ARGS

            raise SystemExit(EXIT_ARGS) from None
        raise
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # a closed pipe is found here, not at exit (a traceback then)
    except DaemonError as exc:
        print(f"rendezvousd: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `rendezvousd status | head`: the reader had what it wanted. Exit as a tool the
        # shell's SIGPIPE ends does, 128 + 13, which no probe code means; stdout goes to
        # /dev/null so the interpreter's own flush at exit finds no pipe to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code
