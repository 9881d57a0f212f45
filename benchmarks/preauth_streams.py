"""Half-open HTTP/2 streams before authentication: what they cost the daemon.

    python benchmarks/preauth_streams.py --sockets 5 --streams 10000 --json-out out.json

A client that opens calls with HEADERS and never sends a body (no END_STREAM)
holds a gRPC call on the server per stream, before any handler or token check
runs. This opens ``--streams`` such streams on each of ``--sockets`` TCP
connections to a fresh daemon (``--method``: the token-less health Check, whose
handler legitimately waits for its body, or Join, without a token unless
``--with-token``), holds them
for ``--hold-s``, then closes the connections. Prints one JSON document: how many
streams the daemon refused (RST_STREAM REFUSED_STREAM), answered (a status) or
left open, and its RSS before, while held and after the connections closed.
Run it against another checkout (PYTHONPATH=that/checkout) for a before/after.

The frames are written with hyperframe and hpack (h2's own layers), not h2: h2
keeps to the peer's SETTINGS_MAX_CONCURRENT_STREAMS, and this client is the one
that does not.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _proc import status_kib
from _report import emit
from hpack import Decoder, Encoder
from hyperframe.frame import (
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from rendezvousd.cli.embedded import spawn

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REFUSED_STREAM = 0x7
METHODS = {
    "health": "/grpc.health.v1.Health/Check",
    "join": "/rendezvous.v1.Rendezvous/Join",
}


@dataclass
class HalfOpen:
    """One TCP connection that opens streams and never finishes them."""

    host: str
    port: int
    refused: int = 0  # RST_STREAM REFUSED_STREAM: turned away by the stream cap
    answered: int = 0  # a gRPC status (trailers), e.g. UNAUTHENTICATED
    reset: int = 0  # any other RST_STREAM without a status first
    # Those resets by their HTTP/2 error code (RFC 9113, section 7).
    reset_codes: Counter[int] = field(default_factory=Counter)
    goaway: bool = False
    closed: bool = False
    _sock: socket.socket = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _pongs: int = field(init=False, default=0)
    _ended: set[int] = field(init=False, default_factory=set)
    _ready: threading.Condition = field(init=False, default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self._sock = socket.create_connection((self.host, self.port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(PREFACE + SettingsFrame(0).serialize())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def open_streams(self, count: int, path: str, token: str = "", batch: int = 200) -> None:
        encoder = Encoder()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{self.host}:{self.port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        out = bytearray()
        for i in range(count):
            frame = HeadersFrame(1 + 2 * i, flags=["END_HEADERS"])  # no END_STREAM
            frame.data = encoder.encode(headers)
            out += frame.serialize()
            if (i + 1) % batch == 0 or i + 1 == count:
                try:
                    self._send(bytes(out))
                except OSError:
                    self.closed = True
                    return
                out.clear()

    def settle(self, timeout: float = 60.0) -> None:
        """Until the daemon answered a PING sent after every HEADERS frame."""
        with self._ready:
            expected = self._pongs + 1
        try:
            self._send(PingFrame(0, opaque_data=b"settled!").serialize())
        except OSError:
            return
        with self._ready:
            self._ready.wait_for(lambda: self._pongs >= expected or self.closed, timeout)

    @property
    def ended(self) -> int:
        return len(self._ended)

    def close(self) -> None:
        self.closed = True
        self._sock.close()

    def _read(self) -> None:
        decoder = Decoder()
        buf = b""
        try:
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 9:
                    frame, length = Frame.parse_frame_header(memoryview(buf[:9]))
                    if len(buf) < 9 + length:
                        break
                    frame.parse_body(memoryview(buf[9 : 9 + length]))
                    buf = buf[9 + length :]
                    self._on_frame(frame, decoder)
        except OSError:
            pass
        finally:
            with self._ready:
                self.closed = True
                self._ready.notify_all()

    def _on_frame(self, frame: Any, decoder: Decoder) -> None:
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self._send(SettingsFrame(0, flags=["ACK"]).serialize())
        elif isinstance(frame, PingFrame):
            if "ACK" in frame.flags:
                with self._ready:
                    self._pongs += 1
                    self._ready.notify_all()
            else:
                # An attacker answers keepalive pings: the connection must not
                # end for want of them.
                self._send(PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"]).serialize())
        elif isinstance(frame, HeadersFrame):
            names = {str(name) for name, _ in decoder.decode(frame.data)}
            if "grpc-status" in names and frame.stream_id not in self._ended:
                self._ended.add(frame.stream_id)
                self.answered += 1
        elif isinstance(frame, RstStreamFrame) and frame.stream_id not in self._ended:
            self._ended.add(frame.stream_id)
            if frame.error_code == REFUSED_STREAM:
                self.refused += 1
            else:
                self.reset += 1
                self.reset_codes[frame.error_code] += 1
        elif isinstance(frame, GoAwayFrame):
            self.goaway = True


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        daemon = spawn(Path(tmp), *args.daemon_flag, exit_with_parent=True)
        try:
            pid = daemon.proc.pid
            host, port = daemon.endpoint.rsplit(":", 1)
            token = daemon.token_file.read_text().strip() if args.with_token else ""
            time.sleep(0.5)
            before = status_kib(pid)
            started = time.monotonic()
            conns = [HalfOpen(host, int(port)) for _ in range(args.sockets)]
            openers = [
                threading.Thread(
                    target=c.open_streams, args=(args.streams, METHODS[args.method], token)
                )
                for c in conns
            ]
            for t in openers:
                t.start()
            for t in openers:
                t.join()
            for c in conns:
                c.settle()
            sent_s = time.monotonic() - started
            # A test's way to wait for every stream's end (it cannot know when a loaded
            # daemon gets to the last one) rather than for a fixed time.
            total = args.sockets * args.streams
            until = time.monotonic() + args.until_ended_s
            while sum(c.ended for c in conns) < total and time.monotonic() < until:
                time.sleep(0.05)
            time.sleep(args.hold_s)
            held = status_kib(pid)
            peak = held
            report: dict[str, Any] = {
                "sockets": args.sockets,
                "streams_per_socket": args.streams,
                "method": METHODS[args.method],
                "with_token": args.with_token,
                "daemon_flags": list(args.daemon_flag),
                "send_s": round(sent_s, 3),
                "refused": sum(c.refused for c in conns),
                "answered": sum(c.answered for c in conns),
                "reset": sum(c.reset for c in conns),
                "reset_codes": dict(sum((c.reset_codes for c in conns), Counter[int]())),
                "goaway": sum(c.goaway for c in conns),
                "connections_closed_by_daemon": sum(c.closed for c in conns),
            }
            report["held_open"] = (
                args.sockets * args.streams
                - report["refused"]
                - report["answered"]
                - report["reset"]
            )
            for c in conns:
                c.close()
            time.sleep(args.after_s)
            after = status_kib(pid)
            report["rss_kib"] = {
                "before": before,
                "held": held,
                "after_close": after,
                "growth_held": peak - before,
                "growth_after_close": after - before,
            }
            report["daemon_alive"] = daemon.proc.poll() is None
            return report
        finally:
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=5)
    parser.add_argument("--streams", type=int, default=10_000, help="streams per socket")
    parser.add_argument("--method", choices=sorted(METHODS), default="health")
    parser.add_argument(
        "--with-token", action="store_true", help="send the admin token (a token holder's cost)"
    )
    parser.add_argument(
        "--until-ended-s",
        type=float,
        default=0.0,
        help="first wait up to this long for every stream to be refused or answered",
    )
    parser.add_argument("--hold-s", type=float, default=5.0)
    parser.add_argument("--after-s", type=float, default=3.0)
    parser.add_argument(
        "--daemon-flag",
        action="append",
        default=[],
        help="a flag for `rendezvousd serve` (repeat; e.g. --daemon-flag=--max-concurrent-streams=50)",
    )
    parser.add_argument("--json-out")
    args = parser.parse_args()
    emit(run(args), args.json_out)


if __name__ == "__main__":
    main()
