"""The torchrun handler's settings (``--rdzv-conf`` over ``RENDEZVOUSD_*``), read as its
``from_parameters`` reads them before anything of torch's runs: no torch needed."""

from __future__ import annotations

import pytest

from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.torchrun.config import load_settings

ADVICE = "pass --rdzv-conf tls_ca=PATH (or set RENDEZVOUSD_TLS_CA)"


@pytest.mark.parametrize(
    ("conf", "env", "said"),
    [
        # Was the SDK's "--tls-cert/--tls-key need --tls-ca": flags torchrun lacks.
        (
            {"tls_cert": "/c.pem", "tls_key": "/k.pem", "token_file": "/t"},
            {},
            "tls_cert needs tls_ca, the CA that signed the daemon's certificate",
        ),
        # Was dropped in silence: the agent spoke plaintext.
        ({"tls_server_name": "daemon.example"}, {}, "tls_server_name needs tls_ca"),
        (
            {},
            {"RENDEZVOUSD_TLS_CERT": "/c.pem", "RENDEZVOUSD_TLS_KEY": "/k.pem"},
            "(tls_cert from $RENDEZVOUSD_TLS_CERT)",
        ),
    ],
    ids=["client pair", "server name", "from the environment"],
)
def test_a_tls_setting_without_tls_ca_is_refused_in_torchruns_words(
    conf: dict[str, str], env: dict[str, str], said: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(conf, env)
    message = str(info.value)
    assert said in message and ADVICE in message, message
    assert "--tls-" not in message, message


@pytest.mark.parametrize(("given", "missing"), [("tls_cert", "tls_key"), ("tls_key", "tls_cert")])
def test_half_a_client_pair_is_refused_naming_the_rdzv_conf_key_it_lacks(
    given: str, missing: str
) -> None:
    """The SDK refused it only when the first client was made, mid-rendezvous, naming
    --tls-cert and --tls-key."""
    with pytest.raises(ConfigError) as info:
        load_settings({"tls_ca": "/ca.pem", given: "/x.pem"}, {})
    message = str(info.value)
    assert f"{given} without {missing}" in message, message
    assert f"pass --rdzv-conf {missing}=PATH" in message and "--tls-" not in message, message


def test_tls_settings_with_their_ca_are_taken() -> None:
    conf = {"tls_ca": "/ca.pem", "tls_cert": "/c.pem", "tls_key": "/k.pem"}
    settings = load_settings({**conf, "tls_server_name": "daemon.example"}, {})
    tls = settings.tls()
    assert tls is not None and tls.server_name == "daemon.example"


def test_torchs_own_keys_a_user_gives_are_said_to_be_unread_and_what_stands_in() -> None:
    """They were dropped without a word: heartbeat_timeout=2 read as failures found in
    2 s, where the daemon's --heartbeat-timeout-s (10 s) applies (a torchrun user's
    review). torchrun's own ``rank`` is not the user's: nothing said of it."""
    from rendezvousd.trainer.torchrun.config import ignored_torch_keys

    said = ignored_torch_keys({"heartbeat_timeout": "2", "is_host": "false", "rank": "0"})
    assert said is not None
    assert "heartbeat_timeout (here: the daemon's --heartbeat-timeout-s)" in said
    assert "is_host" in said and "rank" not in said
    # torchrun itself sets rank and timeout (from --rdzv-timeout) on every launch.
    assert ignored_torch_keys({"rank": "0", "timeout": "900", "join_timeout": "5"}) is None


def test_a_token_on_the_command_line_is_refused_without_its_value() -> None:
    """docs/trainer.md: ``--rdzv-conf token=`` is refused, since a token there shows in
    ``ps``; the refusal says what to pass instead and never echoes the value."""
    with pytest.raises(ConfigError) as info:
        load_settings({"token": "SECRETVALUE", "join_timeout": "5"}, {})
    message = str(info.value)
    assert "--rdzv-conf token: a token on torchrun's command line shows in ps" in message
    assert "token_file=PATH" in message and "RENDEZVOUSD_TOKEN" in message, message
    assert "SECRETVALUE" not in message, message


@pytest.mark.parametrize(
    ("conf", "env", "watch"),
    [
        ({}, {}, True),
        ({"node_link_watch": "0"}, {}, False),
        ({"node_link_watch": "false"}, {}, False),
        ({"node_link_watch": "off"}, {}, False),
        ({"node_link_watch": "true"}, {}, True),
        ({"node_link_watch": "1"}, {}, True),
        ({}, {"RENDEZVOUSD_NODE_LINK_WATCH": "no"}, False),
        # --rdzv-conf over the environment.
        ({"node_link_watch": "yes"}, {"RENDEZVOUSD_NODE_LINK_WATCH": "0"}, True),
    ],
)
def test_node_link_watch_is_read_from_rdzv_conf_over_the_environment(
    conf: dict[str, str], env: dict[str, str], watch: bool
) -> None:
    """docs/trainer.md ("From torchrun"): the handler's agents keep node links unless
    ``--rdzv-conf node_link_watch=0``; what off does is tests/torchrun/test_torchrun.py's
    ``test_node_link_watch_off_keeps_a_torchrun_agent_from_listening_for_links``."""
    assert load_settings(conf, env).node_link_watch is watch


@pytest.mark.parametrize(
    ("conf", "env", "said"),
    [
        ({"node_link_watch": "maybe"}, {}, "--rdzv-conf node_link_watch='maybe' is invalid"),
        ({"node_link_watch": ""}, {}, "--rdzv-conf node_link_watch='' is invalid"),
        (
            {},
            {"RENDEZVOUSD_NODE_LINK_WATCH": "sometimes"},
            "$RENDEZVOUSD_NODE_LINK_WATCH='sometimes' is invalid",
        ),
    ],
    ids=["word", "empty", "environment"],
)
def test_a_node_link_watch_that_is_neither_on_nor_off_is_refused_naming_where_it_came_from(
    conf: dict[str, str], env: dict[str, str], said: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(conf, env)
    message = str(info.value)
    assert said in message and "node_link_watch must be true or false" in message, message
    assert "--node-link-watch" not in message, message  # rendezvous-run's flag, not torchrun's


@pytest.mark.parametrize(
    ("conf", "said"),
    [
        (
            {"join_timout": "60"},
            "--rdzv-conf join_timout: not a key of the rendezvousd backend "
            "(did you mean join_timeout?); its keys are token_file,",
        ),
        (
            {"join_timout": "60", "lastcall_timeout": "1", "zzz": "1"},
            "(join_timout: did you mean join_timeout?; lastcall_timeout: did you mean "
            "last_call_timeout?)",
        ),
        ({"zzz": "1"}, "--rdzv-conf zzz: not a key of the rendezvousd backend; its keys are "),
    ],
    ids=["one", "several", "none close"],
)
def test_a_misspelt_rdzv_conf_key_is_refused_with_the_key_it_likely_meant(
    conf: dict[str, str], said: str
) -> None:
    """Refused listing the backend's keys, but without the "did you mean" that a
    misspelt RENDEZVOUSD_* variable gets (a torchrun user's review): the same rule."""
    with pytest.raises(ConfigError) as info:
        load_settings(conf, {})
    assert said in str(info.value), str(info.value)
