"""Every daemon limit and bad job ids, against real daemon processes.

A limit answers RESOURCE_EXHAUSTED fast (with reason LIMIT_EXCEEDED and the
limit's name when the daemon itself refuses), and the daemon stays healthy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import (
    AuthenticationError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    RendezvousClient,
    RendezvousTimeout,
)
from rendezvousd.server.scope import derive_job_token
from tests.daemon.raw_calls import (
    KIB,
    assert_healthy,
    bearer,
    join_one,
    join_request,
    park_joins,
    raw,
    reason_of,
    wait_members,
)
from tests.daemon.test_scoped_tokens import job_token
from tests.support import DaemonProcess, scrape, spawn_daemon, wait_for


def limited_daemon(tmp: Path, **limits: int) -> Iterator[DaemonProcess]:
    """A daemon with ``limits`` (its settings' names) as flags, killed after: for a fixture."""
    flags = [arg for k, v in limits.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    d = spawn_daemon(tmp, *flags)
    try:
        yield d
    finally:
        d.kill()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from limited_daemon(
        tmp_path_factory.mktemp("limited"), max_keys_per_job=4, max_members_per_job=8, max_waiters=2
    )


# -- message and metadata size ---------------------------------------------------


def test_oversized_message_is_resource_exhausted(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str
) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        m = join_one(client)
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("big", b"v" * (70 * KIB))
        assert info.value.code == "RESOURCE_EXHAUSTED"
        # gRPC refused it before the daemon's code ran; the SDK names the limit.
        assert info.value.limit == "max_message_bytes"
        request = pb.KvSetRequest(
            job_id=job_id, generation=m.generation, rank=0, key="big", value=b"v" * (70 * KIB)
        )
        error = raw(channel, "KvSet", request.SerializeToString(), bearer(daemon))
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        # Nothing was stored, and the membership still works.
        assert client.get_job().kv_keys == 0
        client.kv_set("small", b"v")
    # Unauthenticated oversized bodies are refused too (size before auth or auth first).
    error = raw(channel, "ListJobs", b"\0" * (100 * KIB), None)
    assert error is not None
    assert error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)
    assert_healthy(daemon, job_id + "-after")


@pytest.mark.parametrize("size_kib", [20, 64])
def test_oversized_metadata_is_refused(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str, size_kib: int
) -> None:
    # The daemon sets grpc.max_metadata_size = 16 KiB (hard limit 20 KiB): grpc-core
    # refuses bigger headers with RESOURCE_EXHAUSTED before any handler or auth runs.
    big = [("x-padding", "a" * (size_kib * KIB))]
    for metadata in (big + bearer(daemon), bearer(daemon) + big, big):
        error = raw(channel, "ListJobs", b"", metadata)
        assert error is not None, "a 20 KiB header was accepted"
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.code()
    health = health_pb2_grpc.HealthStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(), metadata=big, timeout=5)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raw(channel, "ListJobs", b"", bearer(daemon)) is None
    assert_healthy(daemon, job_id)


# -- key-value limits ----------------------------------------------------------------


def test_kv_key_and_value_sizes(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        join_one(client)
        client.kv_set("k" * 512, b"")  # the largest key
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("k" * 513, b"")
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_key_bytes")
        assert info.value.code == "RESOURCE_EXHAUSTED"
        # Bytes, not characters: 171 three-byte characters are 513 bytes.
        with pytest.raises(LimitExceeded) as info:
            client.kv_get("€" * 171, wait=False)
        assert info.value.limit == "max_key_bytes"
        for call in (
            lambda: client.kv_add("k" * 513),
            lambda: client.kv_delete("k" * 513),
            lambda: client.kv_compare_and_set("k" * 513, None, b"x"),
        ):
            with pytest.raises(LimitExceeded) as info:
                call()
            assert info.value.limit == "max_key_bytes"

        client.kv_set("v", b"x" * (32 * KIB))  # the largest value
        # A compare-and-set of two largest values fits one request (refused at 64 KiB).
        swapped = client.kv_compare_and_set("v", b"x" * (32 * KIB), b"y" * (32 * KIB))
        assert swapped == (True, b"y" * (32 * KIB))
        client.kv_set("v", b"x" * (32 * KIB))
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("v", b"x" * (32 * KIB + 1))
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_value_bytes")
        with pytest.raises(LimitExceeded) as info:
            client.kv_compare_and_set("v", b"nope", b"y" * (32 * KIB + 1))
        assert info.value.limit == "max_value_bytes"
        assert client.kv_get("v", wait=False) == b"x" * (32 * KIB)  # unchanged
        # Over the daemon's message size, gRPC refuses it unread: still named, and the
        # client's stream goes on serving.
        with pytest.raises(LimitExceeded, match=r"over the 70144 bytes .*max_value_bytes") as info:
            client.kv_set("v", b"x" * (70 * KIB))
        assert info.value.limit == "max_message_bytes"
        assert client.kv_get("v", wait=False) == b"x" * (32 * KIB)
        # Another call's message says nothing of KV values.
        with pytest.raises(LimitExceeded, match=r"over the 70144 bytes") as info:
            client.abort("x" * (70 * KIB))
        assert "max_value_bytes" not in str(info.value)

        for bad in ("", "a\x00b", "new\nline"):
            with pytest.raises(InvalidRequest) as bad_info:
                client.kv_set(bad, b"v")
            assert bad_info.value.reason == "INVALID_ARGUMENT"


def test_keys_per_job(limited: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(limited.endpoint, job_id, token=limited.token) as client:
        join_one(client)
        for i in range(4):
            client.kv_set(f"k{i}", b"v")
        for call in (
            lambda: client.kv_set("k4", b"v"),
            lambda: client.kv_add("counter"),
            lambda: client.kv_compare_and_set("k4", None, b"v"),
        ):
            with pytest.raises(LimitExceeded) as info:
                call()
            assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_keys_per_job")
        client.kv_set("k0", b"replaced")  # replacing is not a new key
        assert client.get_job().kv_keys == 4
        assert client.kv_delete("k1")
        client.kv_set("k4", b"v")
        assert client.get_job().kv_keys == 4


# -- jobs, members, waiters --------------------------------------------------------


def test_max_jobs(start_daemon: Callable[..., DaemonProcess], job_id: str) -> None:
    d = start_daemon("--max-jobs", "2")
    clients = [RendezvousClient(d.endpoint, f"{job_id}-{i}", token=d.token) for i in range(3)]
    try:
        join_one(clients[0])
        join_one(clients[1])
        started = time.monotonic()
        with pytest.raises(LimitExceeded) as info:
            join_one(clients[2])
        assert time.monotonic() - started < 5
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_jobs")
        # A join of an existing job still works (retry of rank 0 of job 0 is idempotent).
        assert clients[0].get_job().summary.world_size == 1
        assert len(clients[0].list_jobs()) == 2
        with pytest.raises(NotFound):
            clients[0].get_job(f"{job_id}-2")
    finally:
        for client in clients:
            client.close()


def test_a_new_job_takes_a_finished_jobs_max_jobs_slot(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """Finished jobs held their slots for --job-ttl-s (600 s): a busy daemon refused new
    jobs while one ran (an SRE review). Only live jobs fill max_jobs now: a new job
    takes the oldest finished job's slot, which is forgotten early, said at INFO."""
    d = start_daemon("--max-jobs", "2")
    done = RendezvousClient(d.endpoint, f"{job_id}-done", token=d.token)
    runs = RendezvousClient(d.endpoint, f"{job_id}-runs", token=d.token)
    new = RendezvousClient(d.endpoint, f"{job_id}-new", token=d.token)
    try:
        join_one(done)
        done.leave()
        assert done.get_job().summary.state == pb.JOB_STATE_ENDED
        join_one(runs)
        runs.start_heartbeat()
        # Before: LimitExceeded "already holds max_jobs=2 jobs" for 600 s.
        assert join_one(new).world_size == 1
        assert {j.job_id for j in new.list_jobs()} == {f"{job_id}-runs", f"{job_id}-new"}
        # Its record gone as at its TTL: a late call of it hears that it ended.
        with pytest.raises(NotFound) as info:
            done.get_job()
        assert "forgotten after it ended" in str(info.value)
        said = f"job {job_id}-done generation 1: ENDED -> GONE (expired early"
        wait_for("the daemon to say it", lambda: said in d.log_path.read_text(), timeout=10)
        line = next(x for x in d.log_path.read_text().splitlines() if said in x)
        assert " INFO " in line and f"slot went to new job '{job_id}-new'" in line, line
        # Its end recorded (job_ends), as at its TTL: its job token minted before it
        # opens no new job of its id.
        stale = derive_job_token(d.token, f"{job_id}-done", issued=int(time.time()) - 60)
        with (
            RendezvousClient(d.endpoint, f"{job_id}-done", token=stale) as late,
            pytest.raises(AuthenticationError, match="mint a new one"),
        ):
            join_one(late)
        # Two live jobs: the next new one is refused, naming them.
        with pytest.raises(LimitExceeded) as full:
            join_one(done)
        assert full.value.limit == "max_jobs"
        assert "holds max_jobs=2 live jobs (forming with a joiner present, or running)" in str(
            full.value
        )
    finally:
        for client in (done, runs, new):
            client.close()


def test_max_members_per_job(limited: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(limited.endpoint, job_id, token=limited.token) as client:
        started = time.monotonic()
        with pytest.raises(LimitExceeded) as info:
            client.join(num_nodes=2, gpus_per_node=8, local_rank=0, node_rank=0, timeout=30)
        assert time.monotonic() - started < 5
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_members_per_job")
        assert "16" in str(info.value)
        with pytest.raises(NotFound):  # the refused join created no job
            client.get_job()


def _failed(d: DaemonProcess, job_id: str) -> bool:
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        return bool(probe.get_job().summary.state == pb.JOB_STATE_FAILED)


def test_max_waiters(limited: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(limited.endpoint, job_id, token=limited.token) as client:
        join_one(client)
        # Two parked joins of another job fill --max-waiters 2 (observable via GetJob).
        parked = park_joins(limited, job_id + "-world", [1, 2], 3)
        try:
            wait_members(limited, job_id + "-world", 2)
            started = time.monotonic()
            with pytest.raises(LimitExceeded) as info:
                client.kv_get("never-set", wait=True, timeout=20)
            assert time.monotonic() - started < 3, "the third waiter was not refused fast"
            assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_waiters")
            # Calls that do not wait are unaffected.
            client.kv_set("k", b"v")
            assert client.kv_get("k", wait=True, timeout=5) == b"v"
        finally:
            for future in parked:
                future.cancel()
        # Cancelled waiters free their slots: waiting works again.
        # (a cancelled parked Join is a dead joiner: it fails that generation)
        wait_for(
            "the cancelled joins to fail their job", lambda: _failed(limited, job_id + "-world")
        )
        with pytest.raises(RendezvousTimeout):
            client.kv_get("never-set", wait=True, timeout=0.2)


def test_join_refused_by_max_waiters_does_not_hold_the_rank(
    limited: DaemonProcess, job_id: str
) -> None:
    parked = park_joins(limited, job_id + "-full", [1, 2], 3)
    probe = RendezvousClient(limited.endpoint, job_id, token=limited.token)
    try:
        wait_members(limited, job_id + "-full", 2)
        with pytest.raises(LimitExceeded):
            probe.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=1, timeout=5)
    finally:
        for future in parked:
            future.cancel()
    try:
        # The refused rank must be free: a retry parks (and times out), no DUPLICATE_RANK.
        wait_for(
            "the cancelled joins to fail their job", lambda: _failed(limited, job_id + "-full")
        )
        with pytest.raises(RendezvousTimeout):
            probe.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=1, timeout=0.5)
        assert len(probe.get_job().members) == 0
    finally:
        probe.close()


def test_max_concurrent_rpcs(start_daemon: Callable[..., DaemonProcess], job_id: str) -> None:
    d = start_daemon("--max-concurrent-rpcs", "4")
    parked = park_joins(d, job_id, [1, 2, 3, 4], 5)
    with grpc.insecure_channel(d.endpoint) as ch:
        try:
            deadline = time.monotonic() + 10
            while True:  # until all four are in flight
                started = time.monotonic()
                error = raw(ch, "ListJobs", b"", bearer(d))
                elapsed = time.monotonic() - started
                if error is not None:
                    break
                assert time.monotonic() < deadline, "four parked calls never filled the limit"
                time.sleep(0.02)
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert elapsed < 2.0, f"refusal took {elapsed:.2f} s"
            # A fifth waiting call is refused just as fast.
            fifth = park_joins(d, job_id, [0], 5)[0]
            with pytest.raises(grpc.RpcError) as info:
                fifth.result(timeout=5)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert all(not f.done() for f in parked), "a parked call ended early"
        finally:
            for future in parked:
                future.cancel()
        deadline = time.monotonic() + 10
        while raw(ch, "ListJobs", b"", bearer(d)) is not None:
            assert time.monotonic() < deadline, "the daemon did not recover after the overload"
            time.sleep(0.05)
    assert_healthy(d, job_id + "-after")


def test_one_jobs_token_leaves_the_last_rpc_slots_to_other_jobs_and_the_admin(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """--max-concurrent-rpcs 8 keeps its last slot (an eighth, at least one) for jobs
    running fewer calls than that and for the admin: job A's token holder parks seven
    joins and its eighth call is refused, naming the share, while the admin's ListJobs
    and job B's calls still get through. (Before: A took all eight, and the admin's
    ``status`` was refused.)"""
    d = start_daemon("--max-concurrent-rpcs", "8", "--metrics-listen", "127.0.0.1:0")
    job_b = job_id + "-b"
    tokens = {job: job_token(d, tmp_path, job).read_text().strip() for job in (job_id, job_b)}

    def park(job: str, ranks: range) -> list[Any]:
        stub = pb_grpc.RendezvousStub(grpc.insecure_channel(d.endpoint))
        metadata = [("authorization", f"Bearer {tokens[job]}")]
        return [
            stub.Join.future(
                join_request(job, 9, rank, host="parked", instance_id=f"parked-{rank}"),
                metadata=metadata,
                timeout=35,
            )
            for rank in ranks
        ]

    parked = park(job_id, range(1, 8))  # rank 0 never comes: seven calls held
    try:
        # Watched on the metrics port: a call to look would take a slot meanwhile.
        waiters = "rendezvousd_waiters"
        wait_for("A's seven joins parked", lambda: scrape(d.metrics_url)[waiters] == 7)
        (eighth,) = park(job_id, range(8, 9))
        with pytest.raises(grpc.RpcError) as info:
            eighth.result(timeout=10)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        reason, meta = reason_of(info.value)
        assert meta.get("limit") == "max_concurrent_rpcs", (reason, meta)
        assert "keeps the last 1" in info.value.details(), info.value.details()
        with grpc.insecure_channel(d.endpoint) as ch:
            assert raw(ch, "ListJobs", b"", bearer(d)) is None  # the admin's status
            b_token = [("authorization", f"Bearer {tokens[job_b]}")]
            assert raw(ch, "ListJobs", b"", b_token) is None  # another job's call
            parked += park(job_b, range(1, 2))  # B's one call takes the last slot
            wait_for(
                "the daemon full",
                lambda: (
                    (e := raw(ch, "ListJobs", b"", bearer(d))) is not None
                    and e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                ),
            )
    finally:
        for future in parked:
            future.cancel()
    assert all(not f.done() or f.cancelled() for f in parked[:7]), "A's parked calls ended"
    assert_healthy(d, job_id + "-after")


def test_one_jobs_token_holds_no_more_calls_than_a_whole_world_needs(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """A job's token holder opening idle call streams is refused past what a world of
    max_members_per_job needs (a call stream and a heartbeat stream per member) plus
    max_waiters_per_job parked calls: 2 x 2 + 2 = 6 here, whatever --max-concurrent-rpcs
    (100,000) leaves free. (Before: only the last eighth of --max-concurrent-rpcs was
    kept, and 20,000 idle streams of one job token took the daemon from 52 to 672 MiB,
    on the way to an out-of-memory kill of every job's daemon: docs/operations.md.)"""
    d = start_daemon("--max-members-per-job", "2", "--max-waiters-per-job", "2")
    job_b = job_id + "-b"
    tokens = {job: job_token(d, tmp_path, job).read_text().strip() for job in (job_id, job_b)}
    hold = threading.Event()

    def idle() -> Iterator[pb.CallBatch]:
        hold.wait(30)
        yield from ()

    channel = grpc.insecure_channel(d.endpoint)
    stub = pb_grpc.RendezvousStub(channel)
    metadata = [("authorization", f"Bearer {tokens[job_id]}")]
    streams = [stub.CallBatches(idle(), metadata=metadata, timeout=30) for _ in range(12)]
    try:
        wait_for("six of A's twelve streams refused", lambda: sum(s.done() for s in streams) >= 6)
        refused = [s for s in streams if s.done()]
        assert len(refused) == 6, "A holds more or fewer than its six calls"
        for call in refused:
            assert call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, call.details()
            reason, meta = reason_of(call)
            assert reason == "LIMIT_EXCEEDED" and meta.get("limit") == "max_concurrent_rpcs"
            details = call.details() or ""
            assert f"job {job_id!r} already runs 6 calls at once" in details, details
            assert "max_members_per_job=2" in details and "max_waiters_per_job=2" in details
        with grpc.insecure_channel(d.endpoint) as ch:
            a_token = [("authorization", f"Bearer {tokens[job_id]}")]
            b_token = [("authorization", f"Bearer {tokens[job_b]}")]
            error = raw(ch, "ListJobs", b"", a_token)  # A's share is spent, on any method
            assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert raw(ch, "ListJobs", b"", b_token) is None  # another job's call
            assert raw(ch, "ListJobs", b"", bearer(d)) is None  # the admin's status
    finally:
        hold.set()
        for call in streams:
            call.cancel()
        channel.close()
    assert_healthy(d, job_id + "-after")


# -- job ids ---------------------------------------------------------------------------

BAD_JOB_IDS = [
    "x" * 129,
    "",
    ".",
    "..",
    "../x",
    "a/b",
    "/abs",
    "a\\b",
    "a\x00b",
    "new\nline",
    "tab\there",
    "del\x7f",
    "sp ace",
    "jöb",
    "a:b",
]


@pytest.mark.parametrize("bad", BAD_JOB_IDS, ids=repr)
def test_bad_job_ids(daemon: DaemonProcess, channel: grpc.Channel, bad: str) -> None:
    with RendezvousClient(daemon.endpoint, bad, token=daemon.token) as client:
        with pytest.raises(InvalidRequest) as info:
            client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
        assert info.value.reason == "INVALID_JOB_ID"
        assert info.value.code == "INVALID_ARGUMENT"
        # Control characters are escaped, never echoed raw into messages (and logs).
        assert not any(c in info.value.message for c in "\x00\n\t\x7f")
        with pytest.raises(InvalidRequest) as info:
            client.get_job(bad or None)
        if bad:
            assert info.value.reason == "INVALID_JOB_ID"
    for method, request in (
        ("GetJob", pb.GetJobRequest(job_id=bad)),
        ("AbortJob", pb.AbortJobRequest(job_id=bad)),
        ("KvGet", pb.KvGetRequest(job_id=bad, generation=1, key="k")),
    ):
        error = raw(channel, method, request.SerializeToString(), bearer(daemon))
        assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT, method
        assert reason_of(error)[0] == "INVALID_JOB_ID", method
    listed = raw_list_jobs(channel, daemon)
    assert bad not in listed


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (
            "h\u00e9llo",
            "job id 'h\\xe9llo' is invalid: its character 2 is '\\xe9'; a job id is 1-128 "
            "characters from [A-Za-z0-9._-]",
        ),
        # Past the 40 characters shown, the one that broke the rule is still named.
        ("a" * 70 + "\u00e9", "'... (34 more characters) is invalid: its character 71 is '\\xe9'"),
        ("", "job id '' is invalid: it is empty"),
        ("p\u0430ris", "job id 'p\\u0430ris' is invalid"),
        # A tab as \x09, as every shown client string (escape.quoted; it was \t here).
        ("tab\there", "job id 'tab\\x09here' is invalid"),
        # Cut as every client string is (escape.quoted): it said "(129 characters)".
        ("x" * 129, "job id '" + "x" * 40 + "'... (89 more characters) is invalid: it is 129 char"),
        ("..", "job id '..' is invalid: a job id is a URL path segment"),
        (".", "take '.' and '..' for the path itself and its parent; use 1-128 characters"),
    ],
    ids=repr,
)
def test_a_bad_job_id_is_shown_escaped_once_and_dots_say_why(
    daemon: DaemonProcess, bad: str, said: str
) -> None:
    """The message showed the repr of an escaped copy ('h\\\\xe9llo'), and refused '..'
    naming only the allowed characters, which '..' is made of."""
    with (
        RendezvousClient(daemon.endpoint, bad, token=daemon.token) as client,
        pytest.raises(InvalidRequest) as info,
    ):
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    assert info.value.reason == "INVALID_JOB_ID"
    assert said in info.value.message, info.value.message
    assert "\\\\" not in info.value.message, info.value.message


def raw_list_jobs(channel: grpc.Channel, d: DaemonProcess) -> list[str]:
    stub = pb_grpc.RendezvousStub(channel)
    return [j.job_id for j in stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(d)).jobs]


def test_longest_job_id_is_valid(daemon: DaemonProcess, channel: grpc.Channel) -> None:
    error = raw(
        channel, "GetJob", pb.GetJobRequest(job_id="x" * 128).SerializeToString(), bearer(daemon)
    )
    assert error is not None and error.code() is grpc.StatusCode.NOT_FOUND
    assert reason_of(error)[0] == "JOB_NOT_FOUND"


def test_limited_daemon_stayed_healthy(limited: DaemonProcess, job_id: str) -> None:
    assert_healthy(limited, job_id)
    assert "Traceback" not in limited.log()


def test_a_larger_max_value_bytes_is_reachable(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """--max-value-bytes 200000 was taken, yet every value over ~64 KiB was refused
    at the fixed 64 KiB request limit: the limit now makes room for it."""
    d = start_daemon("--max-value-bytes", "200000")
    with RendezvousClient(d.endpoint, job_id, token=d.token) as client:
        join_one(client)
        client.kv_set("big", b"v" * 199_000)
        assert client.kv_get("big", wait=False) == b"v" * 199_000
        swapped = client.kv_compare_and_set("big", b"v" * 199_000, b"w" * 199_000)
        assert swapped == (True, b"w" * 199_000)
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("big", b"v" * 200_001)
        assert info.value.limit == "max_value_bytes"
