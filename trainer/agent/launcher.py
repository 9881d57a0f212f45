"""``rendezvous-run``: this node's agent, torchrun-style (elastic agent included).

    rendezvous-run --nnodes 2 --node-rank 0 --nproc-per-node 4 --max-restarts 3 \\
        --rdzv-endpoint head:29420 --token-file /etc/rendezvousd/token train.py --lr 0.1
    rendezvous-run --nnodes 2:4 --node-rank auto --nproc-per-node 4 --max-restarts 3 ...
    rendezvous-run --standalone --nproc-per-node 4 -m mypkg.train
    rendezvous-run --rendezvous-path /run/user/1000/job --nproc-per-node 4 train.py

Settings come from ``--config`` (the trainer TOML), the ``RENDEZVOUSD_*`` env vars
and the flags below (``load_layers``), resolved and validated here once. The
launcher is the node agent (``node_agent.py``): it joins the daemon once for the node,
holding all its local ranks, and hands each worker one assignment over a private
channel (never argv or the environment): its rank and the formed topology, the
generation, the resolved config, the unique id and the member's credentials. Workers are started warm,
before the job forms, one per local rank with torchrun's LOCAL_RANK and
LOCAL_WORLD_SIZE (and RANK, WORLD_SIZE, NODE_RANK when the node's ranks are fixed)
in their environment; ``init_distributed`` sets the rest from the assignment. The
agent heartbeats the daemon for the node and watches its workers (exit, and
progress when they report it); a failure anywhere stops every node's workers
and, while ``--max-restarts`` allows, every agent re-joins the next generation
and restarts its workers from the newest step state any agent holds. ``--nnodes
MIN:MAX`` makes the job elastic. When the restarts are used up the exit status
is non-zero with one message listing every failure, and the root cause the
daemon recorded. ``--standalone`` runs a single node on the file transport: this
agent hosts its daemon on a UNIX socket in a private directory (``--rendezvous-path``,
else a temporary one).

Start-up order matters when a fresh node replaces a lost one (the other nodes
wait for it): this module imports only what reading the settings needs, starts
the node's spares (``worker_boot``), and only then imports the agent, the SDK
and numpy, while the spares import theirs on the other cores.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import os
import signal
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rendezvousd.common.env_names import unknown_names
from rendezvousd.common.escape import quoted
from rendezvousd.common.log_time import utc_stamp
from rendezvousd.common.secret_files import TOKEN_ENV, TOKEN_FILE_ENV, missing_token
from rendezvousd.common.settings import Value, VersionFlag
from rendezvousd.trainer.agent._fork_server import module_names
from rendezvousd.trainer.agent._trace import mark
from rendezvousd.trainer.agent.worker_boot import (
    ForkServer,
    boot_spares,
    discard,
    fork_server_wanted,
)
from rendezvousd.trainer.config import (
    CONFIG_ENV,
    SCHEMA,
    DistributedConfig,
    RendezvousTransport,
    RingAddress,
    load_layers,
)
from rendezvousd.trainer.errors import ConfigError, RestartsExhausted
from rendezvousd.trainer.interfaces import point_socket_ifname

if TYPE_CHECKING:
    from rendezvousd.common.members import Seat
    from rendezvousd.trainer.agent.recovery import Failure
    from rendezvousd.trainer.agent.worker_boot import Booted

# torchrun's spellings, kept as aliases of the config's own flags.
ALIASES = {
    "gpus_per_node": ["--nproc-per-node"],
    "rendezvous.endpoint": ["--rdzv-endpoint"],
    "retry_attempts": ["--retries"],
}
# Per-worker settings: the launcher assigns them, never takes them from its config
# file or environment.
PER_WORKER = ("rank", "local_rank")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rendezvous-run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Every node of a job must run the same version (docs/operations.md, "Upgrading").
    p.add_argument("--version", action=VersionFlag)
    p.add_argument(
        "--config",
        default=None,
        help=f"trainer TOML config; passed to the workers as {CONFIG_ENV} (which the "
        "launcher itself does not read)",
    )
    group = p.add_argument_group("distributed")
    group.add_argument(
        "--nnodes",
        "--num-nodes",
        dest="nnodes",
        default=None,
        metavar="N|MIN:MAX",
        # num_nodes' own default, as the flags SCHEMA adds say theirs.
        help="number of nodes, or the elastic range MIN:MAX (default: "
        f"{SCHEMA.rendered_default(SCHEMA.options['num_nodes'])}) (env RENDEZVOUSD_NUM_NODES, "
        "RENDEZVOUSD_MIN_NODES)",
    )
    SCHEMA.add_arguments(group, aliases=ALIASES, exclude=(*PER_WORKER, "num_nodes"))
    p.add_argument(
        "--standalone",
        action="store_true",
        help="a single node on the file transport: this launcher hosts its daemon",
    )
    p.add_argument(
        "--no-fork-server",
        dest="fork_server",
        action="store_false",
        help="start every spare as a fresh interpreter instead of forking it from this "
        "node's fork server (also RENDEZVOUSD_FORK_SERVER=0)",
    )
    p.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="modules (separated by ',' or ':') the fork server imports besides numpy, gRPC and "
        "the trainer (e.g. torch), so that every spare starts with them",
    )
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module")
    p.add_argument("target", help="script path (or module with -m)")
    rest = p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    # argparse counts REMAINDER as required: a missing target was reported as
    # "required: target, args", though the target's arguments are optional.
    rest.required = False
    return p


def _fail(message: str) -> int:
    _note(f"error: {message}")
    return 2  # recovery.SETUP_ERROR_EXIT (not imported before the spares start)


def _note(message: str) -> None:
    # Stamped as the daemon's log is (UTC, marked): the lines of nodes on hosts in other
    # time zones, and the daemon's, can be put in one order.
    print(f"{utc_stamp()} rendezvous-run: {message}", file=sys.stderr, flush=True)


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> DistributedConfig:
    """The node's config, as its workers will load it; ConfigError if unusable."""
    shared_env = {k: v for k, v in env.items() if k not in _per_worker_env()}
    layers = load_layers(args.config, env=shared_env)
    for key in PER_WORKER:
        # A config file's rank is one worker's too (the shipped single_node.toml has
        # rank = 0): taken for the whole node, it refused any --node-rank but 0.
        layers.pop(key, None)
    flags = SCHEMA.from_cli(args, ALIASES)
    layers.update(flags)
    nnodes = _nnodes(args.nnodes)
    flagged, ranged = flags.get("min_nodes"), nnodes.get("min_nodes")
    if flagged is not None and ranged is not None and flagged.value != ranged.value:
        # Both are flags of this command: neither is the more specific, and the one
        # applied last (--nnodes) was taken without a word.
        raise ConfigError(
            f"{flagged.origin} {flagged.value} disagrees with --nnodes {args.nnodes} (its MIN "
            f"is {ranged.value}): give the elastic minimum once, as --nnodes MIN:MAX or "
            "--min-nodes"
        )
    layers.update(nnodes)
    config = SCHEMA.build([layers])
    if config.is_multi_node and "node_rank" not in layers:
        # The default 0 would put every node on node 0.
        raise ConfigError(
            f"num_nodes={config.num_nodes} needs this node's rank: pass --node-rank "
            "(0..num_nodes-1, or 'auto' to let the daemon assign it), or set "
            "RENDEZVOUSD_NODE_RANK or node_rank in the config file"
        )
    if args.standalone:
        if config.is_multi_node:
            raise ConfigError("--standalone runs a single-machine job: use --nnodes 1")
        # A daemon named on this command line is meant, not overridden: the job ran on
        # a private daemon instead, exit 0, and never showed up where it was asked to.
        # (The environment's endpoint, set for other jobs, is overridden.)
        given = sorted(
            value.origin
            for key, value in flags.items()
            if key.startswith(("rendezvous.endpoint", "rendezvous.token", "rendezvous.tls_"))
            and value.value is not None
        )
        if given:
            raise ConfigError(
                f"--standalone hosts its own daemon, but {' and '.join(given)} "
                f"{'names' if len(given) == 1 else 'name'} another: drop --standalone to "
                "join that daemon, or drop those flags"
            )
        # The file transport, whatever endpoint the environment names.
        return dataclasses.replace(
            config, rendezvous=RendezvousTransport.file(config.rendezvous.path)
        )
    if config.rendezvous.kind != "daemon" and config.rendezvous.path is None:
        raise ConfigError(
            "no rendezvous endpoint: pass --rdzv-endpoint, set RENDEZVOUSD_ENDPOINT, "
            "or use --standalone (or --rendezvous-path) for a single node"
        )
    return config


def _nnodes(text: str | None) -> dict[str, Value]:
    """``--nnodes N`` or torchrun's elastic ``--nnodes MIN:MAX``, as config values; an
    error names --nnodes and its whole value (``:2`` was "--min-nodes='' is invalid")."""
    if text is None:
        return {}
    low, sep, high = text.partition(":")
    parts = {"num_nodes": (high, "MAX"), "min_nodes": (low, "MIN")} if sep else {}
    parts = parts or {"num_nodes": (low, "N")}
    values: dict[str, Value] = {}
    for key, (part, name) in parts.items():
        try:
            values[key] = Value(SCHEMA.options[key].kind.parse(part), "--nnodes")
        except ValueError as exc:
            raise ConfigError(
                f"--nnodes={text!r} is invalid: its {name} {part.strip()!r} {exc}; give N "
                "or MIN:MAX (e.g. --nnodes 2 or --nnodes 2:4)"
            ) from None
    if sep and values["min_nodes"].value > values["num_nodes"].value:
        raise ConfigError(
            f"--nnodes={text!r} is invalid: its MIN {low.strip()} exceeds its MAX "
            f"{high.strip()}; give MIN:MAX with MIN <= MAX"
        )
    return values


# Threads per worker for OpenMP and the BLAS numpy uses (OpenBLAS reads it too).
THREADS_ENV = "OMP_NUM_THREADS"


def _per_worker_env() -> set[str]:
    return {o.env for k, o in SCHEMA.options.items() if k in PER_WORKER and o.env is not None}


def spare_env(
    config: DistributedConfig, config_path: str | None, base: Mapping[str, str]
) -> dict[str, str]:
    """Env for a warm worker, for its user code only: the config file's path and
    the token file's (the worker itself is handed its settings, rank and token
    over the channel, and ``init_distributed`` sets torchrun's names from them).
    Never the token itself: it reached user code and all it starts (DataLoader
    workers, subprocesses, an experiment tracker or crash reporter that records the
    environment), and every process's ``/proc/PID/environ``, though no worker reads
    it (an audit); user code has the worker's client, ``ctx.rendezvous``."""
    dropped = _per_worker_env() | set(TORCHRUN_ENV) | {TOKEN_ENV}
    env = {k: v for k, v in base.items() if k not in dropped}
    if config.rendezvous.token_file is not None:
        env[TOKEN_FILE_ENV] = config.rendezvous.token_file
    if config_path is not None:
        env[CONFIG_ENV] = config_path
    if config.local_world_size > 1 and THREADS_ENV not in base:
        # torchrun's rule: each of a node's workers would otherwise start one
        # OpenMP/OpenBLAS thread per core, N workers x N threads on N cores.
        env[THREADS_ENV] = "1"
    return env


def point_nccl_at(config: DistributedConfig, ring: RingAddress, env: dict[str, str]) -> str:
    """The nccl backend: ``NCCL_SOCKET_IFNAME`` for the workers (``env``) and this
    process, node 0's NCCL bootstrap root (``_id_factory``), set to the interface holding
    the node's advertised address, unless the user set it; as torchrun's handler points
    gloo. Left alone, NCCL takes the first interface it likes, on a multi-homed host not
    the one the nodes reach each other on. Not in the shared-device mode, where every
    rank is on this host and ``devices.prepare_nccl`` keeps NCCL on loopback. Returns
    the interface it chose ("": none), which the agent chooses again with the node's
    address (``NodeAgent._choose_ring``)."""
    if config.backend != "nccl" or env.get("NCCL_SOCKET_IFNAME"):
        return ""
    from rendezvousd.trainer.comm.nccl import SHARED_DEVICE_ENV

    if env.get(SHARED_DEVICE_ENV) == "1":
        return ""
    if (name := point_socket_ifname("NCCL_SOCKET_IFNAME", ring.address, env)) is not None:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
        _note(
            f"NCCL_SOCKET_IFNAME={name} (holds {ring.address}, this node's address, "
            f"{ring.origin}); set NCCL_SOCKET_IFNAME to choose another"
        )
    return name or ""


def _id_factory(config: DistributedConfig) -> Callable[[], bytes] | None:
    if config.backend != "nccl":
        return None  # the SDK's 128 random bytes key the CPU ring

    def create() -> bytes:
        # Imported when node 0 makes the id, not at start-up (numpy, CuPy).
        from rendezvousd.trainer.comm import devices, nccl

        # This process hosts NCCL's bootstrap root for the id it makes, so it must
        # listen where the ranks look: on loopback in the one-GPU shared-device mode.
        devices.prepare_nccl(-1)
        return nccl.create_unique_id()

    return create


def _target_problem(args: argparse.Namespace, token_file: str | None) -> str | None:
    """Why no worker could start the target, said once here: each worker failed at
    start with runpy's traceback, and each failure used a restart. A target that is
    ``token_file`` (the node's, from --token-file or $RENDEZVOUSD_TOKEN_FILE) is
    refused: run as Python, its traceback printed the token (a forgotten --token-file
    before the file's path)."""
    if args.module:
        # The top-level package only (finding a submodule imports its parents), where
        # the workers' `python -m` looks: this directory, then the installed ones (an
        # editable install's finder too, which is not on sys.path).
        top = args.target.split(".")[0]
        here = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
        if here is None and importlib.util.find_spec(top) is None:
            return f"no module named {top!r} to run (-m {args.target}) from {os.getcwd()}"
        return None
    path = Path(args.target)
    if not path.exists():
        return f"the script {args.target!r} does not exist (from {os.getcwd()})"
    if path.is_dir() and not (path / "__main__.py").is_file():
        return f"{args.target!r} is a directory without a __main__.py: give the script"
    if token_file and _same_file(path, token_file):
        return (
            f"the script {args.target!r} is the token file ({token_file}): give the script "
            "to run after the flags (--token-file takes the file's path as its value)"
        )
    return None


def _same_file(path: Path, other: str) -> bool:
    """Whether both name one file (its inode), also through links; False when either
    cannot be looked at (the token file's own read says why, later)."""
    try:
        return os.path.samefile(path, other)
    except OSError:
        return False


def run_agent(
    args: argparse.Namespace, config: DistributedConfig, base: Mapping[str, str], launched: float
) -> int:
    """``launched``: when this launcher started (``time.monotonic()``), which its first
    join tells the daemon: a job whose run ended since refuses it."""
    if (problem := missing_token(config.rendezvous.token_file, base)) is not None:
        return _fail(problem)
    token_file = config.rendezvous.token_file or base.get(TOKEN_FILE_ENV)
    if (problem := _target_problem(args, token_file)) is not None:
        return _fail(problem)
    try:
        # A name that does not resolve yet is waited for as a daemon not up yet is: for
        # the join's timeout (NodeAgent._join), the daemon's pod maybe still starting.
        ring = config.ring_choice(
            _note, max(config.join_timeout_s, config.rendezvous.connect_timeout_s)
        )
    except ConfigError as exc:
        return _fail(str(exc))
    target = ["-m", args.target] if args.module else [args.target]
    cmd = target + [a for a in args.args if a != "--"]
    env = spare_env(config, args.config, base)
    socket_ifname = point_nccl_at(config, ring, env)
    if env.get(THREADS_ENV) == "1" and THREADS_ENV not in base:
        _note(
            f"{THREADS_ENV}=1 for each of the {config.local_world_size} workers of this node "
            "so their threads do not overload it; set it to tune"
        )
    # Before the imports below, so that the spares' start-up (or their fork
    # server's) overlaps this process's.
    server = None
    if args.fork_server:
        preload = module_names(args.preload)
        server = ForkServer.start(env, preload, note=_note)
    try:
        booted = boot_spares(config, cmd, env, server)
        mark("spares-started")
        return _run_agent(args, config, cmd, env, booted, server, ring, launched, socket_ifname)
    finally:
        if server is not None:
            server.close()  # after the agent stopped every worker


def _say_start(config: DistributedConfig) -> None:
    """The node agent's first line of its own: which rendezvousd it runs (every node of
    a job must run one; the daemon's is `rendezvousd status`'s first line) and the wire
    version its workers speak, which the daemon compares across the job's nodes. After
    the spares started: reading the version costs a few milliseconds, tens in a git
    checkout, whose build git is asked for (``version.build_id``)."""
    from rendezvousd.common.version import installed_version
    from rendezvousd.trainer.comm.ring_wire import WIRE_VERSION

    _note(
        f"rendezvousd {installed_version()} (ring wire version {WIRE_VERSION}), node agent "
        f"of job {quoted(config.job_id)}, {config.local_world_size} worker(s)"
    )


def _run_agent(
    args: argparse.Namespace,
    config: DistributedConfig,
    cmd: list[str],
    env: Mapping[str, str],
    booted: list[Booted],
    server: ForkServer | None,
    ring: RingAddress,
    launched: float,
    socket_ifname: str,
) -> int:
    try:
        from rendezvousd.client.connection import resolve_token
        from rendezvousd.client.errors import RendezvousError
        from rendezvousd.client.warnings_said import say_client_warnings
        from rendezvousd.trainer.agent.launcher_words import in_launchers_words
        from rendezvousd.trainer.agent.node_agent import NodeAgent

        say_client_warnings(_note)
        _say_start(config)
        transport = config.rendezvous
        try:
            # Read here first; the client reads its file again when the daemon refuses
            # the token (a rotation), and each assignment hands the workers its current one.
            token = resolve_token(None, transport.token_file)
            client = transport.client(config.job_id, config.retry_attempts, token=token)
        except RendezvousError as exc:
            discard(booted)
            problem = (
                f"cannot talk to the rendezvous daemon at {transport.endpoint}: "
                f"{in_launchers_words(exc)}"
            )
            how = f"gave up: cannot talk to the rendezvous daemon at {transport.endpoint}"
            return _said_end(config, None, how, _fail(problem))
        # The agent owns the spares from here on.
        agent = NodeAgent(
            config,
            cmd,
            env,
            client,
            ring_host=ring.address if config.backend == "cpu" else "",
            ring_origin=ring.origin,
            link_host=ring.address,
            # Without waiting for a name to resolve: a re-join waits for the daemon itself.
            ring_again=lambda: config.ring_choice(None, 0.0),
            socket_ifname=socket_ifname,
            token=token,
            note=_note,
            id_factory=_id_factory(config),
            booted=booted,
            fork_server=server,
            launched=launched,
        )
    except BaseException:
        discard(booted)
        raise
    # As torchrun: a closed terminal or SSH session (SIGHUP) or Ctrl-\ (SIGQUIT) stops
    # the node as SIGTERM does, not by killing it (workers without their grace, the
    # private directory left in /tmp); unless ignored (nohup).
    previous = {
        s: signal.getsignal(s)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    }
    for s, handler in previous.items():
        if s in (signal.SIGTERM, signal.SIGINT) or handler is not signal.SIG_IGN:
            signal.signal(s, lambda signum, _frame: agent.interrupt(signum))
    try:
        status = agent.run()
    except RestartsExhausted as exc:
        _fail(str(exc))
        _root_cause(config, agent.first_local, agent.placed)
        status = exc.exit_status
        # The failures are listed just above, whole: not again, cut to a line.
        budget = agent.budget
        latest = budget.last[-1] if budget.last else budget.first[-1] if budget.first else None
        failures = f"{budget.count} failure{'s' if budget.count != 1 else ''}, listed above"
        how = (
            f"gave up on a failure no restart can change ({failures})"
            if latest is not None and latest.fatal
            else f"gave up after {budget.restarts} of {budget.max_restarts} restarts ({failures})"
        )
    else:
        if status == 0:
            workers = agent.finished_workers
            how = (
                f"finished: all {workers} workers exited 0"
                if workers
                else "finished: not needed, no worker started"
            )
        else:
            how = f"stopped by {signal.Signals(status - 128).name}"
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        agent.client.close()
    return _said_end(config, agent.placed, how, status)


def _said_end(config: DistributedConfig, placed: Seat | None, how: str, status: int) -> int:
    """The node's last line: how it ended and its exit status (docs/trainer.md's
    table), that a log which ends reads apart from a node still running or hung (it
    ended at the start-up banner, or at "got SIGTERM"). ``placed``: this node's seat in
    its last generation, if it had one. Returns ``status``."""
    node = f" node {placed.node_rank}" if placed is not None else ""
    _note(f"job {quoted(config.job_id)}{node} {how} (exit {status})")
    return status


def _root_cause(config: DistributedConfig, local: Failure | None, placed: Seat | None) -> None:
    """The daemon's record of the first rank lost, on any node (named as this node
    when it is of ``placed``, this node's seat in its last generation); failing that,
    this node's first failed worker."""
    from rendezvousd.trainer.agent.root_cause import describe, lost_member

    transport = config.rendezvous
    assert transport.endpoint is not None
    found = lost_member(
        transport.endpoint, config.job_id, transport.token_file, tls=transport.tls()
    )
    if found is not None:
        gen, lost = found
        here = placed is not None and placed.holds(gen, lost.rank)
        _note(f"root cause: {describe(lost, here=here)}")
    elif local is not None:
        who = f"rank {local.rank}" if local.rank is not None else f"local rank {local.local_rank}"
        _note(
            f"root cause: worker {who} on this node ({local.cause}), the first to fail "
            "here; the daemon recorded no lost rank or could not be asked"
        )


def main(argv: Sequence[str] | None = None) -> int:
    mark("launcher-main")
    launched = time.monotonic()
    args = build_parser().parse_args(argv)
    # gRPC core logs every failed TLS handshake at INFO, a line per attempt (three in
    # this process and its spares for one wrong --tls-ca) around the launcher's own
    # error, which names the same failure and what to do. Only a process-wide
    # threshold exists, read when grpc is first imported (not yet: nothing above
    # imports it); ERROR was gRPC's own default before its logging moved to absl.
    # Set before the copy below, so the spares and workers (which import the SDK)
    # keep quiet too; a GRPC_VERBOSITY the user set is kept.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    base = dict(os.environ)
    for unread in unknown_names(base):
        _note(f"warning: {unread}")
    try:
        config = resolve(args, base)
        # Read here, before a daemon is hosted or a spare started, even with
        # --no-fork-server: a value that is neither on nor off is a mistake either way.
        fork_server_wanted(base)
    except ConfigError as exc:
        return _fail(str(exc))
    if config.rendezvous.kind == "daemon":
        return run_agent(args, config, base, launched)
    # The one way to run a single node: the file transport, whose daemon this agent
    # hosts, as a FileRendezvous' local_rank 0 does without a launcher. (Imported
    # here: a node of a daemon's job starts its spares without paying for these.)
    import tempfile

    from rendezvousd.client.errors import RendezvousError
    from rendezvousd.client.transport import host_single_node

    with contextlib.ExitStack() as stack:
        path = config.rendezvous.path
        if path is None:
            sweep_abandoned(Path(tempfile.gettempdir()))
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix=STANDALONE_PREFIX))
        try:
            hosted = stack.enter_context(host_single_node(Path(path), config.job_id))
        except RendezvousError as exc:
            # A --rendezvous-path that is a file, missing under /proc, or open to others.
            return _fail(str(exc))
        endpoint, token_file = hosted
        transport = RendezvousTransport.daemon(endpoint, str(token_file))
        return run_agent(args, dataclasses.replace(config, rendezvous=transport), base, launched)


#: ``--standalone``'s own directory for its daemon's socket and token, in the temp dir.
STANDALONE_PREFIX = "rendezvous-run-"
#: A directory younger than this may belong to a launcher that has not bound yet.
_ABANDONED_AFTER_S = 60.0


def sweep_abandoned(temp: Path) -> None:
    """Remove the ``--standalone`` directories a SIGKILLed launcher left (it never ran
    its clean-up: its token stays on disk): this user's, older than a minute, where
    nothing accepts on any socket."""
    import shutil
    import socket
    import time

    for entry in temp.glob(f"{STANDALONE_PREFIX}*"):
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if time.time() - info.st_mtime < _ABANDONED_AFTER_S:
            continue
        live = False
        for sock_path in entry.glob("*.sock"):
            with socket.socket(socket.AF_UNIX) as probe, contextlib.suppress(OSError):
                probe.settimeout(1.0)
                probe.connect(str(sock_path))
                live = True
        if not live:
            # shutil.rmtree does not follow links inside (rmtree.avoids_symlink_attacks).
            shutil.rmtree(entry, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
