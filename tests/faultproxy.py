"""A fault-injection HTTP proxy for the test suite, on 127.0.0.1 in front of moto's S3 server.

Clients (boto3 in this process or in a pytest subprocess, through ``AWS_ENDPOINT_URL_S3=<proxy.url>``,
path-style addressing on an IP endpoint) talk plain HTTP/1.1 to the proxy, which forwards to the upstream
server. Every connection carries exactly one request: ``Connection: close`` is forced on the upstream
request and on the response relayed back, so the mode is read afresh for every request.

``FaultProxy.mode`` may be changed at any time; it is read once per incoming request, after its head:

``None``
    Pass everything through unchanged (request and response bytes relayed as they are, apart from the
    hop-by-hop headers).
``"503"``
    Answer every request at once with ``503 Service Unavailable`` and an S3-style XML error body
    (code ``SlowDown``), ``Connection: close``; upstream is never contacted.
``"reset-put"``
    PUT requests: read the head and part of the body, then reset the connection (``SO_LINGER`` on with
    0 seconds, then close: a TCP RST). Upstream is never contacted, so nothing is stored. Other requests
    pass through.
``"trickle-get"``
    Object GETs (GET requests that are not listings: no ``list-type`` or ``prefix`` query, and a key in
    the path) are forwarded; the response head reaches the client at once and the body at
    ``trickle_bytes_per_second``, until the body ends or the client goes away. Since botocore's
    ``read_timeout`` is per socket read, a trickle never trips it. Other requests pass through.
``"trickle-put"``
    PUT requests are forwarded (so the object IS stored), and the upstream's whole response, head
    included, reaches the client at ``trickle_bytes_per_second``. Other requests pass through.
``"lose-put-response"``
    PUT requests are forwarded (so the object IS stored); where the upstream answers 2xx, that answer never
    reaches the client, which is reset instead (a TCP RST, as ``"reset-put"``): a PUT that landed and whose response
    was lost. botocore retries it; any other answer (412 to a conditional retry) is relayed. Other requests pass
    through.
``"blackhole"``
    Accept the connection, read whatever arrives, never answer (until the client leaves or ``stop()``).

``Expect: 100-continue`` (which botocore sends for PUT/POST bodies that are file-like objects, not for
``bytes`` bodies) is answered by the proxy itself with ``100 Continue`` and stripped from the request
forwarded upstream. Request bodies are framed by ``Content-Length`` or chunked transfer coding.

``requests`` records ``(method, path+query, mode applied)`` for every request whose head arrived; the
mode applied is None where the current mode does not touch that request (say a GET under "reset-put").

All threads are daemons; ``stop()`` shuts down the listening socket and every client and upstream
socket (which wakes every blocked read, and the trickle loops look at a stop flag at least every 0.2 s),
joins the threads for at most ~0.8 s, then closes whatever is left.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import parse_qsl, urlsplit

_HEAD_LIMIT = 64 * 1024
_TICK_S = 0.2
_STOP_JOIN_S = 0.8
_UPSTREAM_TIMEOUT_S = 60.0
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})
_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>faultproxy</RequestId><HostId>faultproxy</HostId></Error>"
)


class _Gone(Exception):
    """The peer closed its side, or the proxy is stopping."""


class _Reader:
    """Buffered reads from one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _Gone
        self.buf += chunk

    def _take(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read_until(self, sep: bytes, limit: int = _HEAD_LIMIT) -> bytes:
        while True:
            at = self.buf.find(sep)
            if at >= 0:
                return self._take(at + len(sep))
            if len(self.buf) > limit:
                raise ValueError("HTTP head or chunk line too long")
            self._fill()

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        return self._take(n)

    def read_some(self) -> bytes:
        """Whatever is buffered, else one recv; b"" at end of stream."""
        if not self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return b""
            self.buf += chunk
        return self._take(len(self.buf))


@dataclass
class _Head:
    start: str
    headers: list[tuple[str, str]]

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        lines = raw.decode("latin-1").split("\r\n")
        headers = []
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"bad header line {line[:80]!r}")
            headers.append((name.strip(), value.strip()))
        return cls(lines[0], headers)

    def get(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def encode(self, drop: frozenset[str] = _HOP_BY_HOP) -> bytes:
        """The head with the headers in ``drop`` left out and ``Connection: close`` added."""
        lines = [self.start, *(f"{k}: {v}" for k, v in self.headers if k.lower() not in drop), "Connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _body(reader: _Reader, framing: str, length: int = 0) -> Iterator[bytes]:
    """The raw bytes of a message body (chunk framing included): framing is "length", "chunked" or "eof"."""
    if framing == "length":
        left = length
        while left > 0:
            piece = reader.read_some()
            if not piece:
                raise _Gone
            if len(piece) > left:  # never relay bytes past the body
                reader.buf[:0] = piece[left:]
                piece = piece[:left]
            left -= len(piece)
            yield piece
    elif framing == "chunked":
        while True:
            line = reader.read_until(b"\r\n", 4096)
            yield line
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    trailer = reader.read_until(b"\r\n")
                    yield trailer
                    if trailer == b"\r\n":
                        return
            yield reader.read_exact(size + 2)
    else:
        while piece := reader.read_some():
            yield piece


def _request_framing(head: _Head) -> tuple[str, int]:
    if "chunked" in (head.get("transfer-encoding") or "").lower():
        return "chunked", 0
    return "length", int(head.get("content-length") or 0)


def _response_framing(method: str, status: int, head: _Head) -> tuple[str, int]:
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return "length", 0
    if "chunked" in (head.get("transfer-encoding") or "").lower():
        return "chunked", 0
    length = head.get("content-length")
    if length is not None:
        return "length", int(length)
    return "eof", 0


def _origin_form(target: str) -> str:
    """path+query of a request target (absolute-form targets lose their scheme and host)."""
    if target.startswith(("http://", "https://")):
        parts = urlsplit(target)
        return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return target


def _is_object_get(method: str, path_query: str) -> bool:
    if method != "GET":
        return False
    path, _, query = path_query.partition("?")
    if any(key in ("list-type", "prefix") for key, _ in parse_qsl(query, keep_blank_values=True)):
        return False
    bucket, _, key = path.lstrip("/").partition("/")  # path-style: /bucket/key
    return bool(bucket and key)


def _applies(mode: str | None, method: str, path_query: str) -> bool:
    if mode in ("503", "blackhole"):
        return True
    if mode in ("reset-put", "trickle-put", "lose-put-response"):
        return method == "PUT"
    if mode == "trickle-get":
        return _is_object_get(method, path_query)
    return False


class FaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1 that injects the failure named by ``mode`` (see the module)."""

    MODES = (None, "503", "reset-put", "trickle-get", "trickle-put", "lose-put-response", "blackhole")

    def __init__(self, upstream: str, *, trickle_bytes_per_second: float = 1.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, not {upstream!r}")
        if trickle_bytes_per_second <= 0:
            raise ValueError("trickle_bytes_per_second must be positive")
        self.upstream = upstream
        self._upstream_addr = (parts.hostname, parts.port or 80)
        self.trickle_bytes_per_second = float(trickle_bytes_per_second)
        self.url = ""  # set by start()
        self.requests: list[tuple[str, str, str | None]] = []
        self._mode: str | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._socks: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()

    # -- public ---------------------------------------------------------------------------------------

    @property
    def mode(self) -> str | None:
        return self._mode

    @mode.setter
    def mode(self, value: str | None) -> None:
        if value not in self.MODES:
            raise ValueError(f"unknown mode {value!r}; one of {self.MODES}")
        self._mode = value

    def start(self) -> FaultProxy:
        if self._listener is not None:
            raise RuntimeError("FaultProxy already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            listener.settimeout(_TICK_S)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        deadline = time.monotonic() + _STOP_JOIN_S
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            socks = list(self._socks)
            threads = list(self._threads)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept on Linux
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in [self._acceptor, *threads]:
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            leftover = list(self._socks)
            self._socks.clear()
        for sock in leftover:
            sock.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"FaultProxy({self.url or 'not started'} -> {self.upstream}, mode={self.mode!r})"

    # -- plumbing -------------------------------------------------------------------------------------

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                raise _Gone
            self._socks.add(sock)

    def _untrack_close(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                self._socks.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), name="faultproxy-conn", daemon=True)
                self._threads.add(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            reader = _Reader(client)
            head = _Head.parse(reader.read_until(b"\r\n\r\n"))
            method, target, _version = head.start.split(" ", 2)
            path_query = _origin_form(target)
            mode = self.mode
            applied = mode if _applies(mode, method, path_query) else None
            with self._lock:
                self.requests.append((method, path_query, applied))

            if applied == "blackhole":
                while reader.read_some() and not self._stopping.is_set():
                    pass
                return
            if applied == "503":
                self._answer_503(client, method)
                return
            if (head.get("expect") or "").lower() == "100-continue":
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            if applied == "reset-put":
                self._reset(client, reader, head)
                return

            upstream = socket.create_connection(self._upstream_addr, timeout=_UPSTREAM_TIMEOUT_S)
            self._track(upstream)
            upstream.sendall(head.encode(_HOP_BY_HOP | {"expect"}))
            framing, length = _request_framing(head)
            for piece in _body(reader, framing, length):
                upstream.sendall(piece)

            up_reader = _Reader(upstream)
            while True:
                response = _Head.parse(up_reader.read_until(b"\r\n\r\n"))
                status = int(response.start.split(" ", 2)[1])
                if not (100 <= status < 200 and status != 101):
                    break  # interim responses (100 Continue) are the proxy's own business
            framing, length = _response_framing(method, status, response)
            if applied == "lose-put-response" and 200 <= status < 300:
                b"".join(_body(up_reader, framing, length))  # the object is stored; its answer goes nowhere
                self._untrack_close(upstream)
                with contextlib.suppress(OSError):
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            if applied == "trickle-put":
                data = response.encode() + b"".join(_body(up_reader, framing, length))
                self._untrack_close(upstream)
                self._trickle(client, data)
            elif applied == "trickle-get":
                client.sendall(response.encode())
                data = b"".join(_body(up_reader, framing, length))
                self._untrack_close(upstream)
                self._trickle(client, data)
            else:
                client.sendall(response.encode())
                for piece in _body(up_reader, framing, length):
                    client.sendall(piece)
            self._finish(client)
        except (_Gone, OSError, ValueError, IndexError):
            pass
        finally:
            self._untrack_close(upstream)
            self._untrack_close(client)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _answer_503(self, client: socket.socket, method: str) -> None:
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {len(_ERROR_BODY)}\r\n"
            "x-amz-request-id: faultproxy\r\n"
            "Connection: close\r\n\r\n"
        ).encode("latin-1")
        client.sendall(head if method == "HEAD" else head + _ERROR_BODY)
        self._finish(client)

    def _reset(self, client: socket.socket, reader: _Reader, head: _Head) -> None:
        """Read part of the body (at most 1 s), then close with a TCP RST."""
        framing, length = _request_framing(head)
        want = 1 if framing == "chunked" else (length + 1) // 2
        client.settimeout(1.0)
        with contextlib.suppress(OSError):
            while len(reader.buf) < want and not self._stopping.is_set():
                chunk = client.recv(65536)
                if not chunk:
                    break
                reader.buf += chunk
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._untrack_close(client)

    def _trickle(self, client: socket.socket, data: bytes) -> None:
        """Send ``data`` at the trickle rate; stops when the client goes away or the proxy stops."""
        rate = self.trickle_bytes_per_second
        start = time.monotonic()
        sent = 0
        while sent < len(data):
            if self._stopping.is_set():
                raise _Gone
            elapsed = time.monotonic() - start
            allowed = min(len(data), int(elapsed * rate)) - sent
            if allowed > 0:
                client.sendall(data[sent:sent + allowed])
                sent += allowed
                continue
            wait = min(_TICK_S, (sent + 1) / rate - elapsed)
            readable, _, _ = select.select([client], [], [], max(wait, 0.001))
            if readable and not client.recv(65536):
                raise _Gone  # the client closed its side

    def _finish(self, client: socket.socket) -> None:
        """Graceful close: half-close, then read what the client still sends (1 s at most), so that unread
        request bytes do not turn our close into a reset that could destroy the response in flight."""
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)
            client.settimeout(1.0)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not self._stopping.is_set() and client.recv(65536):
                pass
