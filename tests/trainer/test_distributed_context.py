"""``init_distributed`` misuse in real workers under a real ``rendezvous-run``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import DaemonProcess, launcher_cmd


def test_a_second_init_distributed_under_the_launcher_fails_instead_of_hanging(
    tmp_path: Path,
) -> None:
    script = tmp_path / "twice.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    init_distributed()\n"
    )
    launcher = [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--standalone"]
    proc = subprocess.Popen(
        [*launcher, "--nproc-per-node", "2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers on SIGTERM
        proc.communicate(timeout=60)
        pytest.fail("the second init_distributed() waited for a second assignment forever")
    assert proc.returncode != 0
    assert "init_distributed() was already called in this worker" in err, err[-3000:]
    assert "rendezvous-run assigns each worker once" in err


def test_sys_exit_0_inside_the_with_block_is_a_success_not_a_failure(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    # Rank 1 finishes early with sys.exit(0) inside the block; rank 0 is still writing
    # its final checkpoint. Reported as a failure ("SystemExit: 0"), it made node 0's
    # agent stop rank 0 mid-checkpoint and fail the job.
    script = tmp_path / "exit0.py"
    script.write_text(
        "import os, sys, time\n"
        "import numpy as np\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        f"marker, done = {str(tmp_path / 'exited')!r}, {str(tmp_path / 'done')!r}\n"
        "with init_distributed() as ctx:\n"
        "    ctx.communicator.all_reduce(np.ones(4))\n"
        "    if ctx.rank == 1:\n"
        "        open(marker, 'w').write(str(os.getpid()))\n"
        "        sys.exit(0)\n"
        "    while not os.path.exists(marker) or not open(marker).read():\n"
        "        time.sleep(0.05)\n"
        "    pid = int(open(marker).read())\n"
        "    while os.path.exists(f'/proc/{pid}'):\n"
        "        time.sleep(0.05)\n"
        "    time.sleep(1)  # the window in which a reported failure stopped this rank\n"
        "    open(done, 'w').close()\n"
    )
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, n, 1, endpoint=daemon.endpoint, token_file=daemon.token_file),
                "--job-id",
                job_id,
                str(script),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        outs = [n.communicate(timeout=60) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.terminate()
                n.communicate(timeout=60)
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    assert (tmp_path / "done").exists()


class _Rendezvous:
    """What ``_drop_out`` calls on a rendezvous, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.witnesses: list[int | None] = []

    def report_failure(
        self, local_rank: int, cause: str, timeout: float, witness_rank: int | None = None
    ) -> None:
        self.calls.append(("report_failure", cause))
        self.witnesses.append(witness_rank)

    def raise_if_failed(self) -> None:
        self.calls.append(("raise_if_failed",))

    def close(self) -> None:
        self.calls.append(("close",))


def test_a_rank_whose_own_gpu_failed_reports_it_at_once() -> None:
    """A DeviceError (out of memory, a CUDA error) is this rank's own failure: it is
    reported as the cause, not waited on as a peer's, whose notice never comes."""
    from rendezvousd.trainer import distributed
    from rendezvousd.trainer.errors import DeviceError

    rdzv = _Rendezvous()
    started = time.monotonic()
    distributed._drop_out(rdzv, DeviceError("rank 0/2: NCCL all_reduce: GPU 0 is out of memory"), 0)  # type: ignore[arg-type]
    assert rdzv.calls[0][0] == "report_failure" and "GPU 0 is out of memory" in rdzv.calls[0][1]
    assert ("raise_if_failed",) not in rdzv.calls and rdzv.calls[-1] == ("close",)
    assert time.monotonic() - started < distributed.PEER_SETTLE_S


def test_a_rank_relaying_a_neighbours_report_names_that_rank_as_data() -> None:
    """A ring error heard from a neighbour's notice (``reported_by``) is reported with
    that rank as ``witness_rank``: the daemon no longer reads "(reported by rank R)"
    back out of the cause, so without it the witness's own report could not lead."""
    from rendezvousd.trainer import distributed
    from rendezvousd.trainer.errors import PeerConnectionError

    relayed = PeerConnectionError("rank 3: lost rank 1 (reported by rank 2): reset")
    relayed.reported_by = 2
    seen = PeerConnectionError("rank 2: lost rank 1: reset")
    for error, witness in ((relayed, 2), (seen, None)):
        rdzv = _Rendezvous()
        distributed._drop_out(rdzv, error, 1)  # type: ignore[arg-type]
        assert rdzv.witnesses == [witness], (error, rdzv.calls)
