"""Prometheus metrics, scraped from a live daemon."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Callable

import grpc

from rendezvousd.client import AuthenticationError, NodeMembership, RendezvousClient
from tests.support import DaemonProcess, node_with_a_standby, scrape, wait_for, worker_cmd


def test_metrics_follow_a_job_through_join_failure_and_rpcs(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0", "--heartbeat-timeout-s", "3")
    uid = b"\x42" * 128
    victim = subprocess.Popen(
        worker_cmd(d, job_id, 1, 2, 0, 1, "--hold-s", "60"), stdout=subprocess.PIPE, text=True
    )
    with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=0, unique_id=uid, timeout=20)
        c.start_heartbeat(0.2)
        wait_for(
            "both heartbeat streams",
            lambda: scrape(d.metrics_url)["rendezvousd_heartbeat_streams"] == 2,
        )
        m = scrape(d.metrics_url)
        assert m['rendezvousd_jobs{state="running"}'] == 1
        assert m["rendezvousd_members"] == 2
        assert m["rendezvousd_joins_total"] == 2
        assert m["rendezvousd_heartbeat_streams"] == 2
        assert m['rendezvousd_rpc_duration_seconds_count{code="OK",method="Join"}'] == 2
        assert 0 <= m["rendezvousd_heartbeat_age_max_seconds"] < 3
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        wait_for(
            "the failure to be counted",
            lambda: scrape(d.metrics_url).get("rendezvousd_failures_detected_total") == 1,
        )
        m = scrape(d.metrics_url)
        assert m['rendezvousd_jobs{state="failed"}'] == 1
    text = urllib.request.urlopen(d.metrics_url, timeout=5).read()
    assert uid not in text and uid.hex().encode() not in text and d.token.encode() not in text
    # A refused token is counted under the method it was refused at: the unary call's,
    # or, for the SDK's call stream, CallBatches (the token is checked once, as it opens).
    for stream, method in ((False, "ListJobs"), (True, "CallBatches")):
        with (
            RendezvousClient(
                d.endpoint, "x", token="wrong-token-but-long-enough", call_stream=stream
            ) as bad,
            contextlib.suppress(AuthenticationError),
        ):
            bad.list_jobs()
        count = (
            f'rendezvousd_rpc_duration_seconds_count{{code="UNAUTHENTICATED",method="{method}"}}'
        )
        assert scrape(d.metrics_url)[count] == 1


def test_made_up_method_paths_do_not_grow_the_metrics(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    # Unauthenticated callers choose the method path: it must not become a label.
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    before = len(urllib.request.urlopen(d.metrics_url, timeout=5).read())
    with grpc.insecure_channel(d.endpoint) as ch:
        for i in range(300):
            path = f"/rendezvous.v1.Rendezvous/{'M' * 2000}{i}"
            with contextlib.suppress(grpc.RpcError):
                ch.unary_unary(path)(b"", timeout=5)
    page = urllib.request.urlopen(d.metrics_url, timeout=5).read()
    assert b"MMMM" not in page
    assert len(page) < before + 4096, (before, len(page))
    m = scrape(d.metrics_url)
    assert (
        m['rendezvousd_rpc_duration_seconds_count{code="UNAUTHENTICATED",method="unknown"}'] == 300
    )


def test_standby_nodes_are_counted_and_the_count_falls_when_one_is_called(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    with node_with_a_standby(d, job_id) as (node, outcome, standby):
        wait_for(
            "one standby counted",
            lambda: scrape(d.metrics_url).get("rendezvousd_standby_nodes") == 1,
        )
        node.close()  # the node's agent dies: the standby is called into its slot
        standby.join(20)
        assert len(outcome) == 1 and isinstance(outcome[0], NodeMembership), outcome
        wait_for(
            "the count back at 0",
            lambda: scrape(d.metrics_url).get("rendezvousd_standby_nodes") == 0,
        )


def test_the_daemon_process_and_its_gc_are_on_the_metrics_page(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """An operator sees the daemon's memory, CPU and descriptors, and its cyclic GC's
    collections by generation (whose pauses hold every answer in flight)."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    m = scrape(d.metrics_url)
    rss = m["process_resident_memory_bytes"]
    assert 10 << 20 < rss < 2 << 30, rss  # the daemon's own, as /proc has it
    assert m["process_open_fds"] > 0 and m["process_cpu_seconds_total"] > 0
    for generation in "012":
        assert f'python_gc_collections_total{{generation="{generation}"}}' in m, sorted(m)
        assert f'python_gc_objects_collected_total{{generation="{generation}"}}' in m


def test_a_join_that_publishes_the_id_counts_once(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """Node 0's JoinNode answered id_required was counted as a completed join, and
    its PublishId was not: a 2-node job counted 3 joins (once its id was required)."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    agents = [RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(2)]
    try:
        threads = [
            threading.Thread(
                target=a.join_node,
                kwargs={"min_nodes": 2, "max_nodes": 2, "gpus_per_node": 1, "timeout": 20},
            )
            for a in agents
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(a.node_membership is not None for a in agents)
        assert scrape(d.metrics_url)["rendezvousd_joins_total"] == 2
    finally:
        for a in agents:
            a.close()


def test_build_info_says_which_build_the_daemon_runs(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Every daemon said 0.1.0 in its log only: an operator could not tell from the
    scrape which build each daemon runs (after an upgrade of some of them)."""
    import importlib.metadata
    import platform

    import google.protobuf

    from rendezvousd.common.version import build_id

    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    # Two builds of one release were told apart by no label (h139 F3): the build is
    # its own label, and the version's local part ("0.1.0+g873aec9").
    build = build_id()
    assert build
    labels = (
        f'build="{build}",'
        f'grpcio="{grpc.__version__}",protobuf="{google.protobuf.__version__}",'
        f'protocol="rendezvous.v1",python="{platform.python_version()}",state_schema="3",'
        f'version="{importlib.metadata.version("rendezvousd")}+{build}"'
    )
    assert scrape(d.metrics_url)["rendezvousd_build_info{" + labels + "}"] == 1
    release = importlib.metadata.version("rendezvousd")
    assert f"rendezvousd {release}+{build} serving on 127.0.0.1:" in d.log(), d.log()


def test_the_rpc_buckets_reach_the_longest_wait() -> None:
    """A Join or Barrier waits up to --max-wait-s (600 s by default); a top finite
    bucket of 60 s put every longer wait in +Inf, where no quantile reads it."""
    from rendezvousd.common.limits import Timing
    from rendezvousd.server.metrics import Metrics

    metrics = Metrics()
    metrics.observe_rpc("Join", "OK", 500.0)
    bounds = {
        s.labels["le"]: s.value
        for family in metrics.registry.collect()
        if family.name == "rendezvousd_rpc_duration_seconds"
        for s in family.samples
        if s.name.endswith("_bucket")
    }
    assert bounds[str(float(Timing.max_wait_s))] == 1, sorted(bounds)
