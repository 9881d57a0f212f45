"""benchmarks/recovery.py judges the torchrun survivors' exit codes.

It recorded the survivors' agents' ``exit_codes`` and never read them: a run whose
restarted round trained one step and then failed counted as a recovery, its time in
the median. Now a case says how many runs finished (every survivor exited 0) and
times only those. The runs here are the shape ``TorchrunRun.run`` reports; no timing
is asserted."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import benchmark_module


@pytest.fixture
def recovery(monkeypatch: pytest.MonkeyPatch) -> Any:
    return benchmark_module(monkeypatch, "recovery.py")


def _run(recovery: Any, recovery_s: float, codes: list[int | None]) -> dict[str, Any]:
    return {"restarted": True, "recovery_s": recovery_s, **recovery._survivors_exit(codes)}


def test_a_survivor_that_did_not_exit_0_is_named_and_its_run_not_timed(recovery: Any) -> None:
    runs = [
        _run(recovery, 3.0, [0, 0]),
        _run(recovery, 1.0, [0, 1]),  # trained again, then failed
        _run(recovery, 0.5, [0, None]),  # trained again, then hung
        {"restarted": False, "error": "no next round trained within 120 s of the kill"},
    ]
    assert runs[0]["survivors_exited_0"] is True
    assert runs[1]["survivors_exited_0"] is False and "[0, 1]" in runs[1]["error"]
    assert runs[2]["survivors_exited_0"] is False and "[0, None]" in runs[2]["error"]
    summary = recovery._torchrun_summary(runs)
    assert summary["restarted"] == "3 of 4"
    assert summary["finished"] == "1 of 4"
    assert summary["recovery_s_median"] == 3.0  # the failed runs' 1.0 and 0.5 left out


def test_no_finished_run_has_no_median(recovery: Any) -> None:
    summary = recovery._torchrun_summary([_run(recovery, 1.0, [2, 0])])
    assert summary["finished"] == "0 of 1" and summary["recovery_s_median"] is None
