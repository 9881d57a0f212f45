"""Settings that become gRPC channel arguments (C ints, in ms or bytes) are bounded:
an allowed value must never crash ``serve`` with an OverflowError."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.config import SCHEMA, ConfigError, DaemonConfig, load
from rendezvousd.daemon import Daemon
from tests.support import DaemonProcess, write_token

INT32_MAX = 2**31 - 1
#: Each bounded setting's largest value: what the daemon's options derive from it fits
#: a C int (gRPC core refuses INT32_MAX connections itself, with a CHECK).
_BOUNDED: dict[str, float] = {
    "heartbeat_timeout_s": 24 * 24 * 3600,
    "connection_idle_s": 24 * 24 * 3600,
    "max_concurrent_rpcs": INT32_MAX,
    "max_concurrent_streams": INT32_MAX,
    "max_connections": INT32_MAX - 1,
    "max_value_bytes": 512 * 1024 * 1024,
}
#: Every other duration's largest value: the SDK's and the trainer's longest wait (30
#: days), where 1e300 was served as "never".
_DURATIONS = {
    name: 30 * 24 * 3600.0
    for name in SCHEMA.options
    if name.endswith("_s") and name not in _BOUNDED
}
#: What a job must be able to hold beside the largest value, or the daemon refuses the
#: value as one no job could store (a contradiction, refused at start).
_ROOM_FOR_IT = {"max_kv_bytes": 2 * 512 * 1024 * 1024, "max_kv_bytes_per_job": 512 * 1024 * 1024}


@pytest.mark.parametrize(
    ("source", "key", "value", "allowed"),
    [
        ("flag", "heartbeat_timeout_s", "2592000", "<= 2073600"),
        ("flag", "heartbeat_timeout_s", "2148000", "<= 2073600"),
        ("flag", "heartbeat_timeout_s", "1e300", "<= 2073600"),
        ("flag", "connection_idle_s", "2592000", "<= 2073600"),
        ("env", "connection_idle_s", "1e7", "<= 2073600"),
        ("flag", "max_concurrent_streams", "2147483648", "from 1 to 2147483647"),
        ("flag", "max_connections", "2147483647", "from 1 to 2147483646"),
        ("flag", "max_connections", "2147483648", "from 1 to 2147483646"),
        ("flag", "max_concurrent_rpcs", str(2**63), "from 1 to 2147483647"),
        ("flag", "max_value_bytes", "1073741824", "from 1 to 536870912"),
        ("toml", "heartbeat_timeout_s", "3e6", "<= 2073600"),
        pytest.param("toml", "heartbeat_timeout_s", "1" + "0" * 400, "<= 2073600", id="10**400"),
    ],
)
def test_a_value_past_what_grpc_takes_is_refused_naming_it(
    tmp_path: Path, source: str, key: str, value: str, allowed: str
) -> None:
    option = SCHEMA.options[key]
    assert option.env is not None and option.flag is not None
    config_file = None
    env: dict[str, str] = {}
    overrides: dict[str, object] = {}
    if source == "flag":
        overrides[key] = value
        origin = f"{option.flag}={value!r}"
    elif source == "env":
        env[option.env] = value
        origin = f"${option.env}={value!r}"
    else:
        config_file = tmp_path / "rendezvousd.toml"
        config_file.write_text(f"{key} = {value}\n")
        origin = f"{key} in {config_file}="
    with pytest.raises(ConfigError) as refused:
        load(config_file, env=env, overrides=overrides)
    said = str(refused.value)
    assert said.startswith(origin) and f"{key} must be" in said and allowed in said, said


@pytest.mark.parametrize("key", sorted(_DURATIONS))
def test_every_other_duration_is_capped_at_30_days(key: str) -> None:
    room = {"max_wait_s": "2592000"}  # or a long default_wait_s is refused as above it
    assert getattr(load(None, env={}, overrides={**room, key: "2592000"}), key) == 2592000.0
    for value in ("2592000.5", "1e300"):
        with pytest.raises(ConfigError) as refused:
            load(None, env={}, overrides={**room, key: value})
        said = str(refused.value)
        assert f"{key} must be" in said and "<= 2592000" in said, said


def test_serve_refuses_an_overflowing_value_without_a_traceback(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token),
         "--listen", "127.0.0.1:0", "--heartbeat-timeout-s", "2592000"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--heartbeat-timeout-s: '2592000' must be a positive finite number <= 2073600" in (
        done.stderr
    )


def test_every_grpc_option_fits_a_c_int_at_the_settings_maxima() -> None:
    config = DaemonConfig(listen="127.0.0.1:0", **_BOUNDED, **_ROOM_FOR_IT)  # type: ignore[arg-type]
    options = Daemon(config, ["t" * 32])._options()
    too_big = [(name, v) for name, v in options if isinstance(v, int) and v > INT32_MAX]
    assert not too_big


def test_a_daemon_at_every_maximum_serves(start_daemon: Callable[..., DaemonProcess]) -> None:
    every = {**_BOUNDED, **_ROOM_FOR_IT, **_DURATIONS}
    flags = [f for key, top in every.items() for f in (SCHEMA.options[key].flag, str(top))]
    d = start_daemon(*flags)
    assert d.proc.poll() is None


def test_each_bound_is_the_settings_own_and_in_its_doc() -> None:
    """The docs' settings table is generated from the help: it says each range."""
    bounded = {
        key: getattr(option.kind, "maximum", None)
        for key, option in SCHEMA.options.items()
        if getattr(option.kind, "maximum", None) is not None
    }
    assert bounded == {**_BOUNDED, **_DURATIONS}
    for key, top in _BOUNDED.items():
        assert str(int(top)) in SCHEMA.options[key].help, key
    # The rest share one bound, said once under the table.
    operations = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    assert "Every duration is at most 30 days (2592000 s" in operations
