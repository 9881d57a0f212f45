"""The cross-host tests may skip only where nobody asked for them: CI runs as root, and
there a missing ``ip`` or namespace support must fail the run, not hide the claims only
those tests back (tests/support.need_hosts, scripts/test.sh)."""

from __future__ import annotations

import pytest

import rendezvousd.trainer.demo.netns as netns
from tests.support import REQUIRE_HOSTS, ROOT, need_hosts


def _no_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "the 'ip' command is missing")


def test_hosts_asked_for_and_missing_fail_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_hosts(monkeypatch)
    monkeypatch.setenv(REQUIRE_HOSTS, "1")
    with pytest.raises(pytest.fail.Exception, match=r"cut tests need network namespaces.*'ip'"):
        need_hosts("cut tests")


def test_hosts_not_asked_for_skip_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_hosts(monkeypatch)
    monkeypatch.delenv(REQUIRE_HOSTS, raising=False)
    with pytest.raises(pytest.skip.Exception, match="'ip' command is missing"):
        need_hosts("cut tests")


def test_the_suite_asks_for_hosts_when_run_as_root() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert f'if [ "$(id -u)" = 0 ]; then\n  export {REQUIRE_HOSTS}=1\nfi' in script
    assert 'packages="$packages iproute2"' in script
