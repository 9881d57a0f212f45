"""Files the daemon trusts: a state dir others can write and a private key others can
read are refused at start-up, state and token files are never written through a link,
and a token file is replaced whole or not at all."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.cli.embedded import write_token_file
from rendezvousd.errors import ConfigError, DaemonError
from rendezvousd.server.auth import read_token_file, validate_tokens
from rendezvousd.storage import persistence
from rendezvousd.storage.persistence import STATE_FILE, StateStore
from rendezvousd.storage.store_sqlite import DB_FILE, SqliteStore
from tests.support import DaemonProcess, Pki


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_state_dir_others_can_write_is_refused_at_start(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, mode: int
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    with pytest.raises(RuntimeError, match=r"writable by group/others .*chmod 700"):
        start_daemon("--state-dir", str(state))


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o700])
def test_a_private_key_with_a_mode_above_0600_is_refused_at_start(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, pki: Pki, mode: int
) -> None:
    key = tmp_path / "server.key"
    shutil.copy(pki.server_key, key)
    key.chmod(mode)
    with pytest.raises(RuntimeError, match=r"more than 0600.*chmod 600") as info:
        start_daemon("--tls-cert", str(pki.server), "--tls-key", str(key))
    assert "Traceback" not in str(info.value)
    assert "PRIVATE KEY" not in str(info.value)


@pytest.mark.parametrize("which", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_a_tls_file_that_is_a_fifo_is_refused_at_start_not_waited_on(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, pki: Pki, which: str
) -> None:
    """The files were read by path (the key after a stat of its mode): a FIFO nobody
    writes (mode 0600 passes) hung the start-up in the read, deaf to SIGTERM."""
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo, 0o600)
    files = {"--tls-cert": pki.server, "--tls-key": pki.server_key, "--tls-client-ca": pki.ca}
    files[which] = fifo
    with pytest.raises(RuntimeError, match=rf"{fifo} is not a regular file \(prw"):
        start_daemon(*(word for flag, path in files.items() for word in (flag, str(path))))


def test_a_token_path_that_is_a_socket_is_named_not_opened(tmp_path: Path) -> None:
    """Opened first, it was "cannot read token file ...: No such device or address"."""
    path = tmp_path / "token"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        with pytest.raises(ConfigError, match=r"is not a regular file \(srw"):
            read_token_file(path)


def test_a_planted_link_at_a_temp_name_is_never_written_through(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = StateStore(state)
    store.check_dir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # The name an older daemon used for its temp file, and a link left "from a crash".
    (state / f".{STATE_FILE}.{os.getpid()}.tmp").symlink_to(victim)
    store.write({"schema": 1, "jobs": []})
    assert victim.read_text() == "precious"
    assert store.read() == {"schema": 1, "jobs": []}
    store.remove_stale()  # a restart clears temp leftovers (the link, not its target)
    assert not list(state.glob(f".{STATE_FILE}.*.tmp")) and victim.read_text() == "precious"


def test_a_state_file_that_is_a_link_is_refused_and_replaced_not_followed(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    store = StateStore(state)
    store.check_dir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    store.path.symlink_to(victim)
    with pytest.raises(DaemonError, match="symlink is refused"):
        store.read()
    store.write({"schema": 1, "jobs": []})
    assert victim.read_text() == "precious"
    assert stat.S_ISREG(store.path.lstat().st_mode)


def _as_nobody(action: Callable[[], object], said: Path) -> str:
    """What ``action`` raised when run by uid 65534, in a child: the test's own
    process keeps its uid."""
    said.touch()
    said.chmod(0o666)
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            action()
            said.write_text("no error")
        except Exception as exc:
            said.write_text(str(exc))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return said.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_state_file_or_dir_the_daemons_user_cannot_use_says_how_to_keep_the_jobs() -> None:
    """Moving an unreadable state file aside (the remedy for a link) loses every job:
    the user's access is the fix; a dir it cannot write names its uid and the flag."""
    root = Path(tempfile.mkdtemp(prefix="rdzv-state-"))
    try:
        root.chmod(0o755)
        theirs = root / "theirs"  # nobody's dir, holding root's 0600 state file
        theirs.mkdir(mode=0o700)
        StateStore(theirs).write({"schema": 1, "jobs": []})
        os.chown(theirs, 65534, 65534)
        text = _as_nobody(StateStore(theirs).read, root / "said-read")
        assert f"cannot read state file {theirs / STATE_FILE}: Permission denied" in text, text
        assert "give the daemon's user read access (it holds the jobs to restore)" in text
        assert "symlink" not in text
        roots = root / "roots"  # root's dir, not writable by nobody
        roots.mkdir(mode=0o755)
        text = _as_nobody(StateStore(roots).check_dir, root / "said-dir")
        assert f"state dir {roots} is not writable by this daemon's user (uid 65534)" in text
        assert "chown it to that user, or give another --state-dir" in text
    finally:
        shutil.rmtree(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("owner", ["root", "the daemon's user, mode 0000"])
def test_a_state_database_the_daemons_user_cannot_open_says_chown_not_move_it_aside(
    owner: str,
) -> None:
    """A state.db restored from a backup as root, the daemon running as its own user (an
    operator review): "unable to open database file; if it is damaged, move it ...
    aside to start with no jobs", and following that lost every job. Its owner is
    named, with the chown (or chmod) that keeps them."""
    root = Path(tempfile.mkdtemp(prefix="rdzv-state-"))
    try:
        root.chmod(0o755)
        theirs = root / "theirs"  # nobody's dir, holding root's 0600 database
        theirs.mkdir(mode=0o700)
        store = SqliteStore(theirs)
        store.open()
        store.close()
        db = theirs / DB_FILE
        os.chown(theirs, 65534, 65534)
        if owner != "root":
            for f in theirs.iterdir():
                os.chown(f, 65534, 65534)
            db.chmod(0)
        text = _as_nobody(lambda: SqliteStore(theirs).open(), root / "said-db")
        mode = "----------" if owner != "root" else "-rw-------"
        uid = 0 if owner == "root" else 65534
        present = " ".join(str(f) for f in sorted(theirs.glob(f"{DB_FILE}*")))
        fix = "chown 65534:65534" if owner == "root" else "chmod 600"
        assert text == (
            f"state database file {db} is owned by uid {uid} (mode {mode}), and this "
            f"daemon's user (uid 65534) cannot read and write it; run: {fix} {present}, then "
            "start again. Do not move it aside: it is not damaged, and it holds the jobs "
            "to restore"
        ), text
        # The advice works: the file opens once its owner and mode are fixed.
        db.chmod(0o600)
        for f in theirs.iterdir():
            os.chown(f, 65534, 65534)
        text = _as_nobody(lambda: SqliteStore(theirs).open(), root / "said-ok")
        assert text == "no error", text
    finally:
        shutil.rmtree(root)


def test_a_state_file_unreadable_for_its_disk_points_at_the_disk_not_at_moving_it() -> None:
    path = Path("/var/lib/rendezvousd/state.json")
    said = persistence._unreadable(path, OSError(errno.EIO, os.strerror(errno.EIO)))
    assert said.startswith(f"cannot read state file {path}: Input/output error; check the disk")
    assert "(it holds the jobs to restore), or move it aside to start with no jobs" in said
    looped = persistence._unreadable(path, OSError(errno.ELOOP, os.strerror(errno.ELOOP)))
    assert looped.endswith("(a symlink is refused); move it aside to start with no jobs")


def test_a_state_file_that_holds_no_state_document_says_what_to_do(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.write([1, 2])  # type: ignore[arg-type]
    with pytest.raises(DaemonError, match="does not hold a state document") as caught:
        store.read()
    assert "JSON list, not an object" in str(caught.value)
    assert "Move it aside to start with no jobs" in str(caught.value)


def test_a_token_file_that_is_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_token_file(folder)


@pytest.mark.parametrize("mode", [0o755, 0o1777])
def test_a_token_path_that_is_no_file_is_never_told_to_chmod(tmp_path: Path, mode: int) -> None:
    """Its mode was checked first: /dev/null, /tmp or a 0755 directory were told
    "run: chmod 600 ..." (advice that would break the system, and not help)."""
    folder = tmp_path / "tokens"
    folder.mkdir()
    folder.chmod(mode)
    for path in (Path("/dev/null"), folder):
        with pytest.raises(ConfigError, match="is not a regular file") as refused:
            read_token_file(path)
        assert "chmod" not in str(refused.value), refused.value


def test_a_non_ascii_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("ü" * 20 + "\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="non-ASCII"):
        read_token_file(path)
    with pytest.raises(ConfigError, match="non-ASCII"):
        validate_tokens(["x" * 16 + "é"], "$RENDEZVOUSD_TOKEN")


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_token_is_never_written_through_a_link(tmp_path: Path, force: list[str]) -> None:
    """``rendezvousd token --force`` at a link planted in a shared directory overwrote,
    and made 0600, the file the link named."""
    victim = tmp_path / "victim.conf"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    link = tmp_path / "token"
    link.symlink_to(victim)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "token", str(link), *force],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert link.is_symlink()
    if force:
        assert "is a symbolic link" in done.stderr, done.stderr


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_token_write_that_fails_keeps_the_old_token_and_leaves_no_file(
    tmp_path: Path, force: list[str]
) -> None:
    """``--force`` truncated the old file in place: a failed write (here ``ulimit -f 0``,
    as a full disk) left it empty, the old token gone with no new one."""
    token = tmp_path / "token"
    if force:
        token.write_text("old-token-" + "x" * 30 + "\n")
        token.chmod(0o600)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "token", str(token), *force],
        capture_output=True, text=True, timeout=60, check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)),
    )  # fmt: skip
    assert done.returncode == 1, done
    assert done.stderr == f"rendezvousd token: cannot write {token}: File too large\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == (["token"] if force else [])
    if force:
        assert token.read_text() == "old-token-" + "x" * 30 + "\n"


def test_a_replaced_token_is_a_new_file_of_mode_0600(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old-token-" + "x" * 30 + "\n")
    token.chmod(0o644)
    before = token.stat().st_ino
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "token", str(token), "--force"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert token.stat().st_ino != before  # renamed over it, not rewritten in place
    assert len(read_token_file(token)[0]) >= 32
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two other users")
def test_another_users_token_is_not_replaced_by_one_it_cannot_give_them() -> None:
    """Renaming a new file over another user's token (in a directory both may write)
    succeeded, and the daemon's user could then not read its own 0600 token: the new
    file stayed the replacer's (a review). Truncated in place, it was refused EACCES."""
    shared = Path(tempfile.mkdtemp(prefix="rdzv-shared-"))
    try:
        shared.chmod(0o777)  # no sticky bit: anyone may rename over anything here
        token = shared / "token"
        token.write_text("daemon-token-" + "x" * 30 + "\n")
        os.chown(token, 65533, 65533)
        token.chmod(0o600)
        said = shared / "said"
        said.touch()
        said.chmod(0o666)
        pid = os.fork()
        if pid == 0:  # the other user, as a child: the test's process keeps its own
            try:
                os.setgid(65534)
                os.setuid(65534)
                write_token_file(token, replace=True)
                said.write_text("replaced")
            except OSError as exc:
                said.write_text(str(exc))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert "belongs to another user (uid 65533)" in said.read_text(), said.read_text()
        said.unlink()
        assert token.stat().st_uid == 65533
        assert token.read_text() == "daemon-token-" + "x" * 30 + "\n"
        assert [p.name for p in shared.iterdir()] == ["token"]
    finally:
        shutil.rmtree(shared)
