"""DistributedConfig: TOML loading, env and CLI overrides, validation, log line."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from rendezvousd.common.validation import LONGEST_WAIT_S, SHORTEST_HEARTBEAT_S
from rendezvousd.trainer import config as trainer_config
from rendezvousd.trainer.config import (
    SCHEMA,
    DistributedConfig,
    RendezvousTransport,
    add_cli_arguments,
    load_config,
    settings_table,
)
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.topology import MultiNodeTopology

CONFIGS = Path(__file__).resolve().parents[2] / "trainer" / "configs"
DAEMON = RendezvousTransport.daemon("127.0.0.1:29400")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


MULTI = """
[distributed]
num_nodes = 2
gpus_per_node = 2
[distributed.rendezvous]
kind = "daemon"
endpoint = "10.0.0.1:29400"
token_file = "/secrets/token"
"""


def test_shipped_smoke_config_is_two_nodes_of_two_cpu_workers_over_loopback() -> None:
    config = load_config(CONFIGS / "multinode_smoke.toml", env={})
    assert (config.backend, config.num_nodes, config.gpus_per_node) == ("cpu", 2, 2)
    assert config.effective_world_size == 4
    assert config.rendezvous.kind == "daemon"
    assert config.rendezvous.endpoint is not None
    assert config.rendezvous.endpoint.startswith("127.0.0.1:")
    assert config.retry_attempts == 1
    assert config.bucket_cap_mib < DistributedConfig().bucket_cap_mib


def test_shipped_single_node_config_keeps_configured_world_and_rank() -> None:
    config = load_config(CONFIGS / "single_node.toml", env={})
    assert not config.is_multi_node
    topo = config.topology()
    assert (topo.world_size, topo.rank) == (2, 0)


def test_defaults_are_single_node_with_one_retry() -> None:
    config = load_config(None, env={})
    assert config == DistributedConfig()
    assert (config.num_nodes, config.node_rank, config.retry_attempts) == (1, 0, 1)
    assert (config.bucket_cap_mib, config.first_bucket_mib) == (25.0, 1.0)


def test_toml_integers_become_floats_for_float_fields(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[distributed]\nbucket_cap_mib = 4\n"), env={})
    assert isinstance(config.bucket_cap_mib, float) and config.bucket_cap_mib == 4.0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[distributed]\nnum_node = 2\n", "distributed.num_node"),
        ('[distributed.rendezvous]\nkind = "daemon"\nendpont = "h:1"\n', "rendezvous.endpont"),
        ("[distribted]\nnum_nodes = 1\n", "'distribted'"),
        ("world_size = 2\n", "'world_size'"),
    ],
)
def test_unknown_toml_key_is_rejected_by_name(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key) as info:
        load_config(write(tmp_path, text), env={})
    if "." in key:  # a setting's key, which a newer release may have added
        assert "or a key of a newer rendezvousd: --version says which this is" in str(info.value)


def test_other_sections_may_be_allowed_explicitly(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\nsteps = 3\n[distributed]\nworld_size = 2\n")
    with pytest.raises(ConfigError, match="'train'"):
        load_config(path, env={})
    assert load_config(path, env={}, allow_sections=["train"]).world_size == 2


def test_missing_and_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", env={})
    with pytest.raises(ConfigError, match="TOML"):
        load_config(write(tmp_path, "[distributed\n"), env={})


def test_multi_node_topology_validate_requires_daemon_endpoint_when_configured(
    tmp_path: Path,
) -> None:
    # Multi-node over the (default) file transport cannot work across machines.
    with pytest.raises(ConfigError, match="daemon rendezvous transport"):
        DistributedConfig(num_nodes=2, gpus_per_node=2)
    # A daemon transport without an endpoint, or with a malformed one, is rejected.
    with pytest.raises(ConfigError, match="needs endpoint"):
        load_config(
            write(
                tmp_path,
                "[distributed]\nnum_nodes = 2\ngpus_per_node = 1\n"
                '[distributed.rendezvous]\nkind = "daemon"\n',
            ),
            env={},
        )
    for bad in ("", "localhost", "host:0", "host:70000", "http://h:1", ":29400", "::1:5"):
        with pytest.raises(ConfigError, match="endpoint"):
            RendezvousTransport.daemon(bad)
    assert RendezvousTransport.daemon("[::1]:5").endpoint == "[::1]:5"
    assert DistributedConfig(num_nodes=2, gpus_per_node=2, rendezvous=DAEMON).is_multi_node


def test_multi_node_requires_gpus_per_node() -> None:
    with pytest.raises(ConfigError, match="gpus_per_node"):
        DistributedConfig(num_nodes=2, rendezvous=DAEMON)


def test_multi_node_world_size_is_derived_and_must_not_contradict() -> None:
    with pytest.raises(ConfigError, match="world_size=3 contradicts"):
        DistributedConfig(num_nodes=2, gpus_per_node=2, world_size=3, rendezvous=DAEMON)
    config = DistributedConfig(num_nodes=2, gpus_per_node=2, world_size=4, rendezvous=DAEMON)
    assert config.effective_world_size == 4


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"backend": "gloo"}, "backend='gloo'"),
        ({"retry_attempts": -1}, "retry_attempts=-1"),
        ({"world_size": 2, "rank": 2}, "rank=2"),
        ({"num_nodes": 0}, "num_nodes=0"),
        ({"node_rank": 1}, "node_rank=1"),
        ({"bucket_cap_mib": 0}, "bucket_cap_mib=0"),
        ({"collective_timeout_s": float("inf")}, "collective_timeout_s=inf"),
        ({"heartbeat_interval_s": "5"}, "heartbeat_interval_s='5'"),
    ],
)
def test_invalid_values_are_quoted_in_the_error(kwargs: dict[str, object], quoted: str) -> None:
    with pytest.raises(ConfigError, match=quoted):
        DistributedConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["bucket_cap_mib", "first_bucket_mib"])
@pytest.mark.parametrize("mib", [1e-7, 0, 2.0**43 + 1])
def test_a_bucket_size_outside_one_byte_to_8_eib_is_refused_naming_the_smallest(
    tmp_path: Path, key: str, mib: float
) -> None:
    """Bucketing takes int(mib * 1 MiB) bytes: 1e-7 passed as positive, then failed
    every worker mid-job (a first bucket: silently none), past ~1e302 overflowed."""
    path = write(tmp_path, f"[distributed]\n{key} = {mib!r}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    said = str(info.value)
    assert f"{key} in {path}={mib!r} is invalid: {key} must be a size in MiB from " in said, said
    assert "from 9.5367431640625e-07 (one byte, 1/1048576)" in said, said
    # The smallest allowed is allowed, and is one byte.
    smallest = load_config(write(tmp_path, f"[distributed]\n{key} = {2.0**-20!r}\n"), env={})
    assert getattr(smallest, key) * (1 << 20) == 1


def test_node_rank_auto_needs_the_assigned_rank_for_topology(tmp_path: Path) -> None:
    path = write(
        tmp_path, MULTI.replace("gpus_per_node = 2", 'gpus_per_node = 2\nnode_rank = "auto"')
    )
    config = load_config(path, env={})
    assert config.node_rank is None
    # Nothing to say before the daemon has assigned the node rank at join...
    assert config.topology() is None
    # ...after which the same arithmetic places the worker.
    assert dataclasses.replace(config, node_rank=1, local_rank=1).topology().rank == 3


def test_multi_node_topology_from_configured_global_rank() -> None:
    config = DistributedConfig(num_nodes=2, gpus_per_node=2, node_rank=1, rank=2, rendezvous=DAEMON)
    topo = config.topology()
    assert (topo.node_rank, topo.local_rank, topo.world_size) == (1, 0, 4)
    with pytest.raises(ConfigError, match="rank=1 lies on node 0"):
        DistributedConfig(num_nodes=2, gpus_per_node=2, node_rank=1, rank=1, rendezvous=DAEMON)


# ---- environment overrides


@pytest.mark.parametrize(
    ("var", "value", "attr", "expected"),
    [
        ("RENDEZVOUSD_NUM_NODES", "3", "num_nodes", 3),
        ("RENDEZVOUSD_NODE_RANK", "1", "node_rank", 1),
        ("RENDEZVOUSD_NODE_RANK", "auto", "node_rank", None),
        ("RENDEZVOUSD_GPUS_PER_NODE", "8", "gpus_per_node", 8),
        ("RENDEZVOUSD_RETRIES", "0", "retry_attempts", 0),
    ],
)
def test_each_env_override_applies(
    tmp_path: Path, var: str, value: str, attr: str, expected: int | None
) -> None:
    config = load_config(write(tmp_path, MULTI), env={var: value})
    assert getattr(config, attr) == expected


def test_env_endpoint_switches_to_daemon_and_keeps_token_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MULTI), env={"RENDEZVOUSD_ENDPOINT": "10.9.9.9:1234"})
    assert config.rendezvous == RendezvousTransport.daemon("10.9.9.9:1234", "/secrets/token")
    # A file whose multi-node settings come entirely from the environment is valid too.
    config = load_config(
        None,
        env={
            "RENDEZVOUSD_NUM_NODES": "2",
            "RENDEZVOUSD_GPUS_PER_NODE": "4",
            "RENDEZVOUSD_NODE_RANK": "1",
            "RENDEZVOUSD_ENDPOINT": "head:29400",
            "RENDEZVOUSD_LOCAL_RANK": "3",
        },
    )
    assert config.topology().rank == 7


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("RENDEZVOUSD_NUM_NODES", "two"),
        ("RENDEZVOUSD_NUM_NODES", "0"),
        ("RENDEZVOUSD_NODE_RANK", "-1"),
        ("RENDEZVOUSD_NODE_RANK", "first"),
        ("RENDEZVOUSD_GPUS_PER_NODE", "1.5"),
        ("RENDEZVOUSD_GPUS_PER_NODE", ""),
        ("RENDEZVOUSD_RETRIES", "-2"),
        ("RENDEZVOUSD_ENDPOINT", "no-port"),
    ],
)
def test_bad_env_value_names_variable_and_value(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={var: value})
    assert var in str(info.value)
    assert repr(value) in str(info.value)


def test_env_node_rank_out_of_range_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="node_rank=2 is out of range for num_nodes=2"):
        load_config(write(tmp_path, MULTI), env={"RENDEZVOUSD_NODE_RANK": "2"})


def test_load_config_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RENDEZVOUSD_RETRIES", "4")
    assert load_config().retry_attempts == 4


# ---- CLI overrides and precedence


def test_cli_beats_env_beats_file(tmp_path: Path) -> None:
    path = write(tmp_path, MULTI.replace("[distributed]", "[distributed]\nretry_attempts = 3"))
    assert load_config(path, env={}).retry_attempts == 3
    assert load_config(path, env={"RENDEZVOUSD_RETRIES": "2"}).retry_attempts == 2
    config = load_config(path, env={"RENDEZVOUSD_RETRIES": "2"}, cli={"retry_attempts": 5})
    assert config.retry_attempts == 5


def test_argparse_namespace_overrides_only_flags_that_were_given(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(
        [
            "--num-nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--node-rank",
            "auto",
            "--endpoint",
            "h:9",
            "--steps",
            "3",
        ]
    )
    base = write(tmp_path, "[distributed]\nretry_attempts = 2\n")
    config = load_config(base, env={}, cli=args)
    assert (config.num_nodes, config.node_rank, config.retry_attempts) == (2, None, 2)
    assert config.rendezvous == RendezvousTransport.daemon("h:9")


def test_dict_override_with_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown override 'num_node'"):
        load_config(env={}, cli={"num_node": 2})


# ---- rank-0 log line


def test_rank0_log_line_includes_multi_node_fields_and_no_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cr3t-token-value")
    config = DistributedConfig(
        num_nodes=2,
        gpus_per_node=2,
        node_rank=1,
        rendezvous=RendezvousTransport.daemon("10.0.0.1:29400", str(token)),
    )
    line = config.rank0_log_line(MultiNodeTopology(2, 2, 1, 0))
    assert "\n" not in line
    for part in ("num_nodes=2", "gpus_per_node=2", "node_rank=1", "daemon(10.0.0.1:29400"):
        assert part in line
    assert "s3cr3t" not in line


def test_rank0_log_line_single_node_has_no_multi_node_fields() -> None:
    line = DistributedConfig(world_size=2, rank=1).rank0_log_line(MultiNodeTopology(1, 2, 0, 1))
    assert "world_size=2" in line and "rank=1" in line
    assert "num_nodes" not in line and "node_rank" not in line


def test_rank0_log_line_names_the_world_that_formed_not_the_configured_maximum() -> None:
    config = DistributedConfig(
        num_nodes=4, min_nodes=1, gpus_per_node=2, node_rank=None, rendezvous=DAEMON
    )
    line = config.rank0_log_line(MultiNodeTopology(1, 2, 0, 0))
    assert "world_size=2 " in line and "num_nodes=1 (elastic 1..4)" in line, line


def test_a_daemon_transport_always_authenticates_even_without_a_token_file() -> None:
    # The SDK takes the token from RENDEZVOUSD_TOKEN(_FILE) when token_file is unset.
    assert "auth=token," in DAEMON.describe() and "auth=none" not in DAEMON.describe()
    assert "tls=off" in DAEMON.describe()


def test_cpu_shared_memory_from_toml_and_cli(tmp_path: Path) -> None:
    assert DistributedConfig().cpu_shared_memory is True
    path = write(
        tmp_path, MULTI.replace("[distributed]", "[distributed]\ncpu_shared_memory = false")
    )
    assert load_config(path, env={}).cpu_shared_memory is False
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert load_config(env={}, cli=parser.parse_args([])).cpu_shared_memory
    args = parser.parse_args(["--no-cpu-shared-memory"])
    assert load_config(env={}, cli=args).cpu_shared_memory is False
    with pytest.raises(ConfigError, match="cpu_shared_memory='yes' must be true or false"):
        DistributedConfig(cpu_shared_memory="yes")  # type: ignore[arg-type]


# ---- one field-driven path: launcher hand-over, local rank, origins, single-node world


def test_the_handoff_rebuilds_the_config_without_validating_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(
        write(tmp_path, MULTI.replace("[distributed]", '[distributed]\nnode_rank = "auto"')),
        env={},
        cli={"bucket_cap_mib": 0.5, "cpu_shared_memory": False, "job_id": "j1"},
    )
    values = json.loads(json.dumps(config.handoff()))  # as it crosses the channel

    def validated_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the worker validated the agent's config again")

    monkeypatch.setattr(trainer_config, "validate", validated_again)
    assert DistributedConfig.resolved(values) == config
    with pytest.raises(KeyError, match="bucket_cap_mib"):
        DistributedConfig.resolved({k: v for k, v in values.items() if k != "bucket_cap_mib"})


def test_local_rank_places_the_worker_and_must_agree_with_a_fixed_rank() -> None:
    config = load_config(
        None, env={"RENDEZVOUSD_GPUS_PER_NODE": "3", "RENDEZVOUSD_LOCAL_RANK": "2"}
    )
    topo = config.topology()
    assert topo is not None and (topo.world_size, topo.rank) == (3, 2)
    with pytest.raises(ConfigError, match="local_rank=3 is out of range for gpus_per_node=3"):
        dataclasses.replace(config, local_rank=3)
    with pytest.raises(ConfigError, match="not the configured local_rank=2"):
        dataclasses.replace(config, rank=1)
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"RENDEZVOUSD_LOCAL_RANK": "x"})
    assert "RENDEZVOUSD_LOCAL_RANK='x'" in str(info.value)


def test_single_node_world_is_world_size_else_gpus_per_node_and_they_must_agree() -> None:
    assert DistributedConfig(gpus_per_node=3).effective_world_size == 3
    assert DistributedConfig(world_size=2).effective_world_size == 2
    with pytest.raises(ConfigError, match="world_size=2 contradicts gpus_per_node=3"):
        DistributedConfig(world_size=2, gpus_per_node=3)


def test_cross_field_errors_name_where_each_value_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MULTI), env={"RENDEZVOUSD_NODE_RANK": "5"})
    message = str(info.value)
    assert "node_rank from $RENDEZVOUSD_NODE_RANK" in message
    assert f"num_nodes from distributed.num_nodes in {tmp_path / 'config.toml'}" in message


def test_a_malformed_address_is_quoted_once_with_its_origin() -> None:
    """It read "$RENDEZVOUSD_ENDPOINT='head' is invalid: endpoint='head' is malformed"."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"RENDEZVOUSD_ENDPOINT": "head"})
    message = str(info.value)
    assert "$RENDEZVOUSD_ENDPOINT='head' is malformed: expected" in message, message
    assert message.count("'head'") == 1, message


def test_bad_toml_and_flag_values_quote_value_and_origin(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"distributed\.num_nodes in .*='two'"):
        load_config(write(tmp_path, '[distributed]\nnum_nodes = "two"\n'), env={})
    with pytest.raises(
        ConfigError, match=r"--node-rank='first' is invalid: node_rank must be a node rank"
    ):
        load_config(None, env={}, cli={"node_rank": "first"})
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--node-rank", "-3"])
    assert parser.parse_args(["--node-rank", "auto"]).node_rank == "auto"
    assert parser.parse_args(["--node-rank", "1"]).node_rank == 1


def test_every_setting_has_a_toml_key_and_the_documented_env_names_exist() -> None:
    envs = {o.env for o in SCHEMA.options.values()}
    for name in (
        "RENDEZVOUSD_NUM_NODES",
        "RENDEZVOUSD_NODE_RANK",
        "RENDEZVOUSD_GPUS_PER_NODE",
        "RENDEZVOUSD_ENDPOINT",
        "RENDEZVOUSD_RETRIES",
        "RENDEZVOUSD_BACKEND",
        "RENDEZVOUSD_JOB_ID",
        "RENDEZVOUSD_LOCAL_RANK",
        "RENDEZVOUSD_RING_HOST",
    ):
        assert name in envs
    table = settings_table()
    assert all(f"`{key}`" in table for key in SCHEMA.options)


@pytest.mark.parametrize("flag", ["standby", "standby_if_full"])
def test_a_standby_needs_the_daemon_and_an_assigned_node_rank(flag: str) -> None:
    with pytest.raises(ConfigError, match="standby needs the daemon rendezvous transport"):
        DistributedConfig(**{flag: True})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pass --node-rank auto"):
        DistributedConfig(
            num_nodes=2,
            gpus_per_node=2,
            node_rank=1,
            rendezvous=DAEMON,
            **{flag: True},  # type: ignore[arg-type]
        )
    ok = DistributedConfig(
        num_nodes=2,
        gpus_per_node=2,
        node_rank=None,
        rendezvous=DAEMON,
        **{flag: True},  # type: ignore[arg-type]
    )
    assert getattr(ok, flag) and ok.node_rank is None


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"tls_ca": "ca.pem", "tls_cert": "c.pem"}, "tls_cert and tls_key go together"),
        ({"tls_ca": "ca.pem", "tls_key": "k.pem"}, "tls_cert and tls_key go together"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "needs tls_ca to verify the daemon"),
        ({"tls_server_name": "rdzv.internal"}, "tls_server_name needs tls_ca"),
    ],
)
def test_tls_settings_that_cannot_work_alone_are_refused_naming_the_pair(
    fields: dict[str, str], said: str
) -> None:
    """Half a client certificate, or a certificate or server name without the CA that
    verifies the daemon, would fail only at the first connect (or not use TLS at all):
    refused when the config is built, saying what goes with what."""
    with pytest.raises(ConfigError, match=said):
        RendezvousTransport(kind="daemon", endpoint="rdzv:29420", **fields)


def test_a_file_transport_with_daemon_settings_and_the_reverse_are_refused() -> None:
    with pytest.raises(ConfigError, match="kind='file' takes only 'path'"):
        RendezvousTransport(kind="file", path="/tmp/rdzv", token_file="/tmp/token")
    with pytest.raises(ConfigError, match="is only for kind='file'"):
        RendezvousTransport(kind="daemon", endpoint="rdzv:29420", path="/tmp/rdzv")


# ---- bounds: what an SDK call or a thread's wait takes later, refused at config time

#: Every wait the config holds: each ends up in an SDK call or a thread's wait.
WAITS = sorted(key for key in SCHEMA.options if key.endswith("_s"))


def test_every_wait_is_bounded_by_the_sdks_longest_wait() -> None:
    assert "heartbeat_interval_s" in WAITS and "rendezvous.connect_timeout_s" in WAITS
    for key in WAITS:
        kind = SCHEMA.options[key].kind
        assert kind.check(LONGEST_WAIT_S) == LONGEST_WAIT_S, key
        for bad in (LONGEST_WAIT_S + 1, 1e300, float("nan"), float("inf"), -1.0, True):
            with pytest.raises(ValueError, match="30 days"):
                kind.check(bad)


@pytest.mark.parametrize(
    ("var", "value", "named"),
    [
        # ~9.2e9 s and up: threading's waits raised OverflowError when the node stopped.
        ("RENDEZVOUSD_STOP_GRACE_S", "1e308", "stop_grace_s"),
        # kv_get() and join_node() refused them in every worker, or at the join.
        ("RENDEZVOUSD_SETUP_TIMEOUT_S", "1e300", "setup_timeout_s"),
        ("RENDEZVOUSD_JOIN_TIMEOUT_S", "1e12", "join_timeout_s"),
        ("RENDEZVOUSD_LAST_CALL_S", "1e300", "last_call_s"),
        ("RENDEZVOUSD_REJOIN_TIMEOUT_S", "2592001", "rejoin_timeout_s"),
        ("RENDEZVOUSD_CONNECT_TIMEOUT_S", "0.0001", "connect_timeout_s"),
        # The agent's heartbeat busy-looped at 62 % of a core (and the daemon's too).
        ("RENDEZVOUSD_HEARTBEAT_INTERVAL_S", "1e-9", "heartbeat_interval_s"),
        ("RENDEZVOUSD_HEARTBEAT_INTERVAL_S", "0.01", "heartbeat_interval_s"),
        # The protocol's uint32: the agent's first progress report raised ValueError.
        ("RENDEZVOUSD_MAX_RESTARTS", "4294967296", "max_restarts"),
        # The daemon's job id rule: the join failed after the spares started.
        ("RENDEZVOUSD_JOB_ID", "a b", "job_id"),
        ("RENDEZVOUSD_JOB_ID", "h\u00e9llo", "job_id"),
        ("RENDEZVOUSD_JOB_ID", "x" * 129, "job_id"),
        ("RENDEZVOUSD_JOB_ID", "..", "job_id"),
        # The protocol's uint32 counts: refused at the join (exit 1), after the spares
        # started, or by the SDK's client (the retries).
        ("RENDEZVOUSD_NUM_NODES", "4294967296", "num_nodes"),
        ("RENDEZVOUSD_GPUS_PER_NODE", "4294967296", "gpus_per_node"),
        ("RENDEZVOUSD_WORLD_SIZE", "4294967296", "world_size"),
        ("RENDEZVOUSD_MIN_NODES", "4294967296", "min_nodes"),
        ("RENDEZVOUSD_RETRIES", "4294967296", "retry_attempts"),
    ],
)
def test_a_value_no_call_could_carry_is_refused_naming_its_variable(
    var: str, value: str, named: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={var: value})
    assert f"${var}={value!r} is invalid: " in str(info.value)
    assert named in str(info.value)


def test_the_bounds_themselves_are_accepted() -> None:
    config = load_config(
        None,
        env={
            "RENDEZVOUSD_MAX_RESTARTS": str(2**32 - 1),
            "RENDEZVOUSD_STOP_GRACE_S": str(LONGEST_WAIT_S),
            "RENDEZVOUSD_HEARTBEAT_INTERVAL_S": str(SHORTEST_HEARTBEAT_S),
            "RENDEZVOUSD_LAST_CALL_S": "0",
            "RENDEZVOUSD_HANG_TIMEOUT_S": "0.001",
            "RENDEZVOUSD_JOB_ID": "x" * 128,
        },
    )
    assert (config.max_restarts, config.stop_grace_s) == (2**32 - 1, LONGEST_WAIT_S)
    assert (config.heartbeat_interval_s, config.last_call_s) == (SHORTEST_HEARTBEAT_S, 0.0)


def test_a_world_larger_than_the_protocol_carries_is_refused_naming_both_counts() -> None:
    """Each count fit a uint32, but the world they make (JoinNode's world_size and the
    ranks, uint32 too) did not: the join failed at the daemon, after the spares ran."""
    env = {
        "RENDEZVOUSD_NUM_NODES": "65536",
        "RENDEZVOUSD_GPUS_PER_NODE": "65536",
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_ENDPOINT": "rdzv:29420",
    }
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    said = str(info.value)
    assert "num_nodes=65536 x gpus_per_node=65536 = 4294967296 workers, more than the " in said
    assert "4294967295 a world can hold" in said, said
    env["RENDEZVOUSD_GPUS_PER_NODE"] = "65535"
    config = load_config(None, env=env)
    assert config.num_nodes * (config.gpus_per_node or 0) == 2**32 - 2**16


def test_the_counts_bounds_themselves_are_accepted() -> None:
    top = str(2**32 - 1)
    config = load_config(
        None,
        env={"RENDEZVOUSD_WORLD_SIZE": top, "RENDEZVOUSD_GPUS_PER_NODE": top,
             "RENDEZVOUSD_RETRIES": top},
    )  # fmt: skip
    assert (config.world_size, config.retry_attempts) == (2**32 - 1, 2**32 - 1)


def test_a_bound_refused_in_a_file_or_by_a_flag_names_it(tmp_path: Path) -> None:
    path = write(tmp_path, "[distributed]\nmax_restarts = 100000000000000000000\n")
    with pytest.raises(ConfigError, match=r"distributed\.max_restarts in .*is invalid: max_rest"):
        load_config(path, env={})
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    for flag, value in [
        ("--max-restarts", "5000000000"),
        ("--stop-grace-s", "1e308"),
        ("--job-id", "a b"),
        ("--heartbeat-interval-s", "0"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, value])
    with pytest.raises(ConfigError, match=r"job_id='a b' must be a job id the daemon takes"):
        DistributedConfig(job_id="a b")


@pytest.mark.parametrize(
    "var",
    [
        "RENDEZVOUSD_TLS_CA",
        "RENDEZVOUSD_TLS_CERT",
        "RENDEZVOUSD_TLS_KEY",
        "RENDEZVOUSD_RENDEZVOUS_PATH",
    ],
)
@pytest.mark.parametrize("blank", ["", " "], ids=["empty", "space"])
def test_an_empty_path_is_refused_in_the_daemons_words(var: str, blank: str) -> None:
    # The trainer said "must be a non-empty string" where the daemon says how to leave
    # the setting unset (helper-73).
    endpoint = {} if var == "RENDEZVOUSD_RENDEZVOUS_PATH" else {"RENDEZVOUSD_ENDPOINT": "h:1"}
    with pytest.raises(ConfigError) as info:
        load_config(None, env={**endpoint, var: blank})
    said = str(info.value)
    assert f"${var}={blank!r}" in said and "must be a path, not empty or blank" in said, said
    with pytest.raises(ConfigError, match="token_file must be a path, not empty or blank"):
        load_config(None, env={"RENDEZVOUSD_ENDPOINT": "h:1"}, cli={"token_file": blank})
