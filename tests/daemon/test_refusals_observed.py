"""Refusals an operator must see: a limit's (counted by the limit's name, its value
and use as gauges, a throttled WARNING naming the setting to raise) and a bad token
on the status/metrics port (counted as method="http", logged per host, never the
token) (h147 F3, F4)."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import LimitExceeded, RendezvousClient
from rendezvousd.server.scope import derive_job_token
from tests.daemon.raw_calls import bearer, join_one, join_request
from tests.support import ROOT, DaemonProcess, scrape, wait_for


def test_a_limit_refusal_is_counted_by_its_limit_and_logged_once_a_minute(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon(
        "--metrics-listen", "127.0.0.1:0", "--max-jobs", "1", "--max-kv-bytes-per-job", "1000"
    )
    samples = scrape(d.metrics_url)
    assert samples['rendezvousd_limit{limit="max_jobs"}'] == 1
    assert samples['rendezvousd_limit{limit="max_kv_bytes_per_job"}'] == 1000
    # Alerts need every series from start, at 0.
    assert samples['rendezvousd_limit_refused_total{limit="max_jobs"}'] == 0
    assert samples['rendezvousd_limit_used{limit="max_jobs"}'] == 0
    with RendezvousClient(d.endpoint, job_id, token=d.token) as held:
        join_one(held)
        held.kv_set("k", b"v" * 100)
        for _ in range(3):
            with (
                RendezvousClient(d.endpoint, job_id + "-late", token=d.token) as late,
                pytest.raises(LimitExceeded),
            ):
                join_one(late)
        with pytest.raises(LimitExceeded):
            held.kv_set("big", b"x" * 2000)

        def used() -> bool:
            s = scrape(d.metrics_url)
            return (
                s['rendezvousd_limit_used{limit="max_jobs"}'] == 1
                and s['rendezvousd_limit_used{limit="max_kv_bytes"}'] == 101
                and s['rendezvousd_limit_used{limit="max_kv_bytes_per_job"}'] == 101
            )

        wait_for("the used gauges at the next tick", used)
        held.leave()
    # A finished job fills no max_jobs slot (its slot goes to the next new job), so
    # it is no use against the limit either: 1 for --job-ttl-s was a false alert.
    wait_for(
        "the finished job's slot free",
        lambda: scrape(d.metrics_url)['rendezvousd_limit_used{limit="max_jobs"}'] == 0,
    )
    samples = scrape(d.metrics_url)
    assert samples['rendezvousd_limit_refused_total{limit="max_jobs"}'] == 3
    assert samples['rendezvousd_limit_refused_total{limit="max_kv_bytes_per_job"}'] == 1
    lines = [line for line in d.log().splitlines() if "limit max_" in line]
    jobs = [line for line in lines if "limit max_jobs refused" in line]
    # One line for three refusals: the minute's throttle holds the other two back.
    assert len(jobs) == 1, lines
    assert "WARNING" in jobs[0] and f"job '{job_id}-late'" in jobs[0], jobs
    assert "--max-jobs" in jobs[0], jobs
    kv = [line for line in lines if "limit max_kv_bytes_per_job refused" in line]
    assert len(kv) == 1 and f"job '{job_id}'" in kv[0], lines
    # The refusal's own words say to delete keys; the line adds the setting to raise.
    assert "start the daemon with a larger --max-kv-bytes-per-job" in kv[0], kv


def _get(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_a_bad_token_on_the_http_port_is_counted_and_logged_per_host(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    base = d.metrics_url.removesuffix("/metrics")
    assert scrape(d.metrics_url)['rendezvousd_auth_refused_total{method="http"}'] == 0
    wrong = "wrong-token-guessed-over-http-0123456789"
    for i in range(5):
        assert _get(base + "/api/jobs", f"{wrong}{i}") == 401
    assert _get(base + "/api/jobs", d.token) == 200
    login = urllib.request.Request(base + "/login", data=b"token=also-wrong", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(login, timeout=10)
    assert refused.value.code == 401
    assert scrape(d.metrics_url)['rendezvousd_auth_refused_total{method="http"}'] == 6
    log = d.log()
    lines = [line for line in log.splitlines() if "status page: refused" in line]
    # Five Bearer refusals from one host within a minute: one line; the login its own.
    bearer = [line for line in lines if "a Bearer request to '/api/jobs'" in line]
    assert len(bearer) == 1 and len(lines) == 2, lines
    assert "WARNING" in bearer[0] and "from 127.0.0.1:" in bearer[0], bearer
    assert wrong not in log and "also-wrong" not in log and d.token not in log


def test_the_metrics_table_lists_every_family_and_its_help_agrees(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """docs/operations.md's metrics table against a live /metrics: every rendezvousd_*
    family documented and every documented one exported; and joins_refused's help
    counts a forming generation's refusals, as the table does (h147 F7)."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    with urllib.request.urlopen(d.metrics_url, timeout=10) as answer:
        page = answer.read().decode()
    # A counter's family is typed under its name without _total, and each has a
    # _created gauge of its own: neither is a metric of ours to document.
    exported = {
        re.sub(r"_(total|info)$", "", line.split()[2])
        for line in page.splitlines()
        if line.startswith("# TYPE rendezvousd_") and not line.split()[2].endswith("_created")
    }
    table = (ROOT / "docs/operations.md").read_text()
    documented = {
        re.sub(r"_(total|info)$", "", m.group(1))
        for m in re.finditer(r"^\| `(rendezvousd_[a-z_]+)", table, re.MULTILINE)
    }
    assert documented == exported, (sorted(documented - exported), sorted(exported - documented))
    help_line = next(
        line for line in page.splitlines() if line.startswith("# HELP rendezvousd_joins_refused")
    )
    assert "forming" in help_line, help_line


def test_a_gates_refusal_is_counted_and_logged_too(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The concurrency gates (here max_concurrent_rpcs) refuse before any handler runs:
    counted and said the same way; and observed in rpc_duration as the servicer observes
    the unary calls it answers (RendezvousdRejectingCalls and the "Rejected calls"
    panel read it: a unary call the gate refused reached neither), an accepted call
    still once."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0", "--max-concurrent-rpcs", "1")
    with grpc.insecure_channel(d.endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        # A Join of a 2-rank world parks, holding the one slot.
        parked = stub.Join.future(
            join_request(job_id, 2, 0, host="h", instance_id="i0", unique_id=b"\x17" * 128),
            metadata=bearer(d),
            timeout=30,
        )
        wait_for("the join parked", lambda: scrape(d.metrics_url)["rendezvousd_waiters"] == 1)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(d), timeout=10)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        parked.cancel()
        wait_for("the join's slot free", lambda: scrape(d.metrics_url)["rendezvousd_waiters"] == 0)
        stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(d), timeout=10)
    assert (
        scrape(d.metrics_url)['rendezvousd_limit_refused_total{limit="max_concurrent_rpcs"}'] == 1
    )
    assert _rpc_count(d, "ListJobs", "RESOURCE_EXHAUSTED") == 1
    assert _rpc_count(d, "ListJobs", "OK") == 1
    (line,) = [line for line in d.log().splitlines() if "limit max_concurrent_rpcs" in line]
    assert "job (none)" in line and "larger --max-concurrent-rpcs" in line, line


def test_a_bound_that_is_no_setting_names_no_flag(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """max_key_bytes is a fixed bound: the line says so, and names no flag that does
    not exist."""
    d = start_daemon()
    with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
        join_one(c)
        with pytest.raises(LimitExceeded):
            c.kv_set("k" * 600, b"v")
    (line,) = [line for line in d.log().splitlines() if "limit max_key_bytes" in line]
    assert "--max-key-bytes" not in line and "a fixed bound" in line, line


def _rpc_count(d: DaemonProcess, method: str, code: str) -> float:
    key = f'rendezvousd_rpc_duration_seconds_count{{code="{code}",method="{method}"}}'
    return scrape(d.metrics_url).get(key, 0.0)


def test_a_refused_heartbeat_stream_or_health_call_is_counted(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """Only unary calls (and those on a call stream) were observed: a Heartbeat stream
    with job A's token for job B (PERMISSION_DENIED), or for a job that does not exist
    (NOT_FOUND), left every metric as it was, so RendezvousdRejectingCalls and the
    "Rejected calls" panel never saw it. Each stream is observed once, at its end."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    other = job_id + "-b"
    token_a = derive_job_token(d.token, job_id)
    with RendezvousClient(d.endpoint, other, token=d.token) as b:
        join_one(b)
        b.start_heartbeat()
        with grpc.insecure_channel(d.endpoint) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            for token, job, code in (
                (token_a, other, grpc.StatusCode.PERMISSION_DENIED),
                (d.token, job_id + "-absent", grpc.StatusCode.NOT_FOUND),
            ):
                before = _rpc_count(d, "Heartbeat", code.name)
                beats = stub.Heartbeat(
                    iter([pb.HeartbeatRequest(job_id=job, rank=0, instance_id="x" * 32)]),
                    metadata=(("authorization", f"Bearer {token}"),),
                    timeout=10,
                )
                with pytest.raises(grpc.RpcError) as refused:
                    list(beats)
                assert refused.value.code() is code, refused.value
                wait_for(
                    f"the Heartbeat {code.name} counted",
                    lambda c=code, n=before: _rpc_count(d, "Heartbeat", c.name) == n + 1,
                )
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as unknown:
                health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
            assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
            # Observed as the call ends, which may be just after its answer reached here.
            wait_for(
                "the Check NOT_FOUND counted", lambda: _rpc_count(d, "Check", "NOT_FOUND") == 1
            )
        # The member's own stream, open all along, is no observation per beat.
        assert _rpc_count(d, "Heartbeat", "OK") == 0
