"""Rank-0-only atomic checkpoints and rank-0-only logging."""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from rendezvousd.trainer import checkpoint, raw_dtypes
from rendezvousd.trainer.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    rank_zero_logger,
    save_checkpoint,
)
from rendezvousd.trainer.errors import CheckpointError
from rendezvousd.trainer.topology import MultiNodeTopology
from tests.trainer import fake_cupy

# Each worker is a separate interpreter: node/local rank from argv, one JSON line out.
WORKER = """
import json, sys
import numpy as np
from rendezvousd.trainer.checkpoint import save_checkpoint
from rendezvousd.trainer.topology import MultiNodeTopology
path, node, local = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
topo = MultiNodeTopology(num_nodes=2, gpus_per_node=2, node_rank=node, local_rank=local)
arrays = {"w": np.full((3, 2), float(topo.rank)), "step": np.array(7)}
wrote = save_checkpoint(path, arrays, {"writer": topo.rank}, rank=topo)
print(json.dumps({"rank": topo.rank, "wrote": wrote}))
"""


def arrays() -> dict[str, np.ndarray]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2], np.int64)}


@pytest.mark.slow
def test_rank_zero_checkpoint_writes_from_exactly_one_process_globally(tmp_path: Path) -> None:
    target = tmp_path / "ckpt-0000000007.npz"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(target), str(node), str(local)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
        for local in range(2)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    assert [r["rank"] for r in reports if r["wrote"]] == [0]
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    loaded, meta = load_checkpoint(target)
    assert meta == {"writer": 0}
    np.testing.assert_array_equal(loaded["w"], np.zeros((3, 2)))
    assert int(loaded["step"]) == 7


def test_round_trip_preserves_arrays_dtypes_and_meta(tmp_path: Path) -> None:
    path = tmp_path / "c.npz"
    meta = {"step": 3, "lr": 0.1, "tags": ["a"], "nested": {"k": None}}
    # Names that are also np.savez keyword parameters must not collide with them.
    saved = {**arrays(), "file": np.array(["x", "yz"]), "allow_pickle": np.ones((0, 3))}
    assert save_checkpoint(path, saved, meta, rank=0)
    loaded, got_meta = load_checkpoint(path)
    assert got_meta == meta
    assert set(loaded) == set(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].dtype == value.dtype


def test_bfloat16_arrays_come_back_as_bfloat16(tmp_path: Path) -> None:
    # The .npy format keeps an extension dtype as raw bytes ("|V2"): before, it came
    # back untyped and assigning it to a bfloat16 parameter said only "No cast
    # function available".
    ml_dtypes = pytest.importorskip("ml_dtypes")
    path = tmp_path / "ckpt.npz"
    arrays = {
        "w": np.array([[1.5, -2.25], [3e38, 0.0]], dtype=ml_dtypes.bfloat16),
        "f8": np.array([1.0, -0.5], dtype=ml_dtypes.float8_e4m3fn),
        "raw": np.zeros(2, "V3"),
    }
    save_checkpoint(path, arrays, {"step": 1}, rank=0)
    loaded, _ = load_checkpoint(path)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype, name
        assert loaded[name].tobytes() == array.tobytes(), name
    target = np.zeros((2, 2), dtype=ml_dtypes.bfloat16)
    target[...] = loaded["w"]
    assert target.tobytes() == arrays["w"].tobytes()


def test_an_extension_dtype_that_cannot_be_loaded_typed_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, {"w": np.ones(2, ml_dtypes.bfloat16)}, {"step": 1}, rank=0)
    # As where ml_dtypes is missing (or knows no such type): refused, not untyped bytes.
    monkeypatch.setattr(raw_dtypes, "by_name", lambda name: None)
    with pytest.raises(
        CheckpointError, match=r"array 'w' was saved as bfloat16.*install ml_dtypes"
    ):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"array 'w' has dtype bfloat16.*float32"):
        save_checkpoint(tmp_path / "b.npz", {"w": np.ones(2, ml_dtypes.bfloat16)}, {}, rank=0)
    assert not (tmp_path / "b.npz").exists()


def test_device_arrays_round_trip_through_an_explicit_host_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fake's arrays raise on np.asarray, as CuPy's do: saving must copy explicitly.
    fake = fake_cupy.install(monkeypatch)
    path = tmp_path / "c.npz"
    host = arrays()
    on_device = {name: fake.asarray(value) for name, value in host.items()}
    copies = fake.counts["asnumpy"]
    assert save_checkpoint(path, on_device, {"step": 1}, rank=0)
    assert fake.counts["asnumpy"] == copies + len(host)
    back, meta = load_checkpoint(path, xp=fake)
    assert meta == {"step": 1} and set(back) == set(host)
    for name, value in host.items():
        assert isinstance(back[name], fake.ndarray), name
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(fake.asnumpy(back[name]), value)
    # Without xp the same file loads on the host: checkpoints do not record a device.
    on_host, _ = load_checkpoint(path)
    assert all(type(on_host[name]) is np.ndarray for name in host)


def test_resume_onto_device_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rendezvousd.trainer.example import init_params, load_into, params_digest

    fake = fake_cupy.install(monkeypatch)
    host = init_params(features=4, hidden=3, seed=0)
    saved = {k: v + 1 for k, v in host.items()}
    path = checkpoint_path(tmp_path, 5)
    save_checkpoint(path, {k: fake.asarray(v) for k, v in saved.items()}, {"step": 5}, rank=0)
    params = {k: fake.asarray(v) for k, v in host.items()}
    assert load_into(path, params, fake)[0] == 5
    assert all(isinstance(v, fake.ndarray) for v in params.values())
    assert params_digest(params) == params_digest(saved)


def test_non_zero_ranks_do_not_touch_the_file_system(tmp_path: Path) -> None:
    assert not save_checkpoint(tmp_path / "c.npz", arrays(), {}, rank=3)
    assert not save_checkpoint(tmp_path / "c.npz", arrays(), {}, rank=MultiNodeTopology(2, 2, 1, 0))
    assert list(tmp_path.iterdir()) == []


def test_failed_replace_keeps_old_checkpoint_and_leaves_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.npz"
    save_checkpoint(path, arrays(), {"version": "old"}, rank=0)

    def crash(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    new = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(2, np.int64)}
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*c\.npz"):
        save_checkpoint(path, new, {"version": "new"}, rank=0)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]
    loaded, meta = load_checkpoint(path)
    assert meta == {"version": "old"}
    np.testing.assert_array_equal(loaded["w"], arrays()["w"])


def test_missing_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent.npz")


def _member(array: np.ndarray, shape: tuple[int, ...] | None = None) -> bytes:
    """``array`` as an .npy member, its header declaring ``shape`` if given."""
    header = {"descr": array.dtype.str, "fortran_order": False, "shape": shape or array.shape}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + array.tobytes()


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "garbage", "plain_npz", "plain_npy", "huge_shape", "deep_meta"],
)
def test_corrupt_checkpoint_is_a_checkpoint_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"w": np.arange(4096, dtype=np.float64)}, {"s": 1}, rank=0)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        # Inside the first member's payload, past its local header and .npy header.
        data[600] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    elif damage == "plain_npz":
        np.savez(path, w=np.zeros(2))  # valid npz, but no metadata record
    elif damage == "plain_npy":
        path.write_bytes(_member(np.zeros(2)))  # np.load returns an array, no archive
    else:
        # Edited by hand, intact CRCs: a 100-byte member that claims 800 TB, or
        # metadata nested deeper than the JSON decoder's recursion limit.
        with zipfile.ZipFile(path, "w") as archive:
            if damage == "huge_shape":
                archive.writestr("w.npy", _member(np.zeros(4), shape=(10**14,)))
            else:
                deep = ("[" * 100_000 + "]" * 100_000).encode()
                meta = np.frombuffer(deep, dtype=np.uint8)
                archive.writestr(f"{checkpoint._META_KEY}.npy", _member(meta))
    # Garbage left by earlier tests in this worker is finalized now, not by a collection
    # inside the decoder's deepest recursion, where a finalizer has no stack left and
    # pytest failed this test on the unraisable RecursionErrors (CI, once).
    gc.collect()
    with pytest.raises(CheckpointError, match=str(path.name)):
        load_checkpoint(path)


def test_unsaveable_inputs_are_rejected_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "c.npz"
    with pytest.raises(CheckpointError, match="dtype object"):
        save_checkpoint(path, {"o": np.array([{}], dtype=object)}, {}, rank=0)
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(path, arrays(), {"bad": object()}, rank=0)
    assert list(tmp_path.iterdir()) == []


def test_latest_checkpoint_picks_highest_step_and_ignores_other_files(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None
    for step in (5, 40, 300):
        save_checkpoint(checkpoint_path(tmp_path, step), arrays(), {"step": step}, rank=0)
    (tmp_path / ".ckpt-0000009999.npz.abc.tmp").write_bytes(b"partial")
    (tmp_path / "ckpt-notes.npz").write_bytes(b"")
    (tmp_path / "ckpt-99999999999.npz").mkdir()
    latest = latest_checkpoint(tmp_path)
    assert latest == checkpoint_path(tmp_path, 300)
    assert load_checkpoint(latest)[1] == {"step": 300}


def test_rank_zero_logger_suppresses_info_elsewhere_but_not_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "rendezvousd.test.rank_zero"
    caplog.set_level(logging.INFO, logger=name)
    rank0 = rank_zero_logger(name, MultiNodeTopology(2, 2, 0, 0))
    other = rank_zero_logger(name, MultiNodeTopology(2, 2, 1, 0))
    rank0.info("from rank 0")
    other.info("from node 1 local 0")
    other.warning("warning from node 1")
    assert [r.getMessage() for r in caplog.records] == ["from rank 0", "warning from node 1"]
    assert logging.getLogger(name).isEnabledFor(logging.INFO)
    assert not other.isEnabledFor(logging.INFO) and rank0.isEnabledFor(logging.INFO)


def test_resume_refuses_a_checkpoint_of_another_model_or_without_a_step(tmp_path: Path) -> None:
    from rendezvousd.trainer.example import init_params, load_into

    params = init_params(features=4, hidden=3, seed=0)
    other = init_params(features=4, hidden=5, seed=0)
    wrong_shape = checkpoint_path(tmp_path, 2)
    save_checkpoint(wrong_shape, other, {"step": 2}, rank=0)
    with pytest.raises(
        CheckpointError, match=f"rank 0 cannot resume: checkpoint {re.escape(str(wrong_shape))}"
    ):
        load_into(wrong_shape, params)
    no_step = checkpoint_path(tmp_path, 3)
    save_checkpoint(no_step, params, {"loss": 1.0}, rank=0)
    with pytest.raises(CheckpointError, match="no valid step"):
        load_into(no_step, params)
    before = {k: v.copy() for k, v in params.items()}
    good = checkpoint_path(tmp_path, 4)
    saved = {k: v + 1 for k, v in params.items()}
    save_checkpoint(good, saved, {"step": 4}, rank=0)
    assert load_into(good, params)[0] == 4
    assert all(np.array_equal(params[k], saved[k]) for k in params)
    assert not np.array_equal(params["w1"], before["w1"])


@pytest.mark.parametrize("rank", [-1, True, 1.0, "0"])
def test_a_rank_that_is_not_a_global_rank_is_refused(tmp_path: Path, rank: object) -> None:
    """A bool or a float rank must not pass for rank 0 (True == 1, 0.0 == 0) and write,
    or be taken for another rank and silently skip the save."""
    with pytest.raises(CheckpointError, match="must be a global rank"):
        save_checkpoint(tmp_path / "c.npz", arrays(), {}, rank=rank)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("step", [-1, True, 2.0])
def test_a_step_that_is_not_a_count_is_refused(tmp_path: Path, step: object) -> None:
    with pytest.raises(CheckpointError, match="must be an integer >= 0"):
        checkpoint_path(tmp_path, step)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", checkpoint._META_KEY])
def test_an_array_name_that_is_empty_or_reserved_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(CheckpointError, match="empty, not a string, or reserved"):
        save_checkpoint(tmp_path / "c.npz", {name: np.zeros(2)}, {}, rank=0)
    assert list(tmp_path.iterdir()) == []


def _rewrite_meta(path: Path, change: dict[str, object]) -> None:
    """``path`` as another writer would leave it: its metadata record changed."""
    with np.load(path, allow_pickle=False) as archive:
        contents = {name: archive[name] for name in archive.files}
    doc = json.loads(contents[checkpoint._META_KEY].tobytes())
    doc.update(change)
    contents[checkpoint._META_KEY] = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
    np.savez(path.with_suffix(""), **contents)  # np.savez adds the .npz back


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"format": "some-later-format/2"}, "format is 'some-later-format/2'"),
        ({"arrays": ["w", "x"]}, "array list does not match"),
        ({"meta": ["not", "a", "dict"]}, "array list does not match"),
    ],
)
def test_a_checkpoint_of_another_format_or_with_arrays_missing_is_refused(
    tmp_path: Path, change: dict[str, object], said: str
) -> None:
    """A file of another format version, or one whose arrays are not those its
    metadata lists (one lost, one added by hand), is refused, naming the file, rather
    than resumed from with arrays missing."""
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"w": np.arange(3.0)}, {"step": 1}, rank=0)
    _rewrite_meta(path, change)
    with pytest.raises(CheckpointError, match=f"{path.name}.*{re.escape(said)}"):
        load_checkpoint(path)


def test_a_save_removes_what_a_killed_save_left_and_nothing_else(tmp_path: Path) -> None:
    old = time.time() - 60
    left = [tmp_path / ".ckpt-0000000003.npz.k2j4x9_a.tmp", tmp_path / ".c.npz.abcdefgh.tmp"]
    kept = [tmp_path / ".other.npz.abcdefgh.tmp", tmp_path / "notes.tmp"]
    for path in (*left, *kept):
        path.write_bytes(b"partial")
        os.utime(path, (old, old))
    # One of this name being written now (touched after the save began) is not abandoned.
    busy = tmp_path / ".ckpt-0000000004.npz.zzzzzzzz.tmp"
    busy.write_bytes(b"")
    os.utime(busy, (time.time() + 60, time.time() + 60))
    assert save_checkpoint(tmp_path / "c.npz", arrays(), {}, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c.npz", busy.name, *(p.name for p in kept)]
    )


def test_a_save_leaves_the_file_another_live_save_still_writes(tmp_path: Path) -> None:
    """A concurrent saver's file untouched since before this save began (its disk slow,
    or its host's clock ahead of this one's) was deleted under it as abandoned (review
    h159): a file a live writer holds locked is left; the same file, its writer dead
    (the lock released), is removed."""
    old = time.time() - 60
    live = tmp_path / ".ckpt-0000000003.npz.livewrit.tmp"
    live.write_bytes(b"partial")
    os.utime(live, (old, old))
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(live)!r}, os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "locked\n"
        assert save_checkpoint(tmp_path / "ckpt-0000000004.npz", arrays(), {}, rank=0)
        assert live.exists()
    finally:
        writer.kill()
        writer.wait(10)
    assert save_checkpoint(tmp_path / "ckpt-0000000005.npz", arrays(), {}, rank=0)
    assert not live.exists()
