"""A loopback S3 that fails: moto's server behind a small HTTP proxy on 127.0.0.1 that answers a share of
requests with a 5xx, a stall past the client's read timeout, or a dropped connection.

Faults are deterministic (every ``period``-th request, of ``methods`` and to ``paths`` if given, ``kinds``
in turn) and bounded: at most ``max_faults`` of them, and none once ``seconds`` have passed since the start, so a
test that retries always finishes.
Clients reach it with `FlakyS3.storage_options` (short timeouts, so a stall costs about a second).
"""

from __future__ import annotations

import http.client
import itertools
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pipeline.storage import Location


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client of the loopback store at ``endpoint`` (moto's server, or `FlakyS3`'s proxy)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def upload_shards(endpoint: str, bucket: str, urls: list[str]) -> None:
    """Creates ``bucket`` in the loopback store at ``endpoint`` and uploads each shard there as
    ``shards/<its file name>``."""
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    for url in urls:
        client.upload_file(url, bucket, f"shards/{Path(url).name}")


FAULTS = ("503", "stall", "500", "drop")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}
READ_TIMEOUT_S = 1.0
STALL_S = 1.5 * READ_TIMEOUT_S
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FlakyS3:
    """Start with `start`, stop with `stop`; `faults` counts what was injected, by kind."""

    def __init__(
        self,
        *,
        period: int = 4,
        max_faults: int = 40,
        seconds: float = 120.0,
        kinds: tuple[str, ...] = FAULTS,
        methods: tuple[str, ...] | None = None,
        paths: str | None = None,
    ):
        from moto import server as moto_server

        self.moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.period, self.max_faults, self.seconds = period, max_faults, seconds
        self.requests = 0
        self.faults: Counter[str] = Counter()
        self.kinds = itertools.cycle(kinds)
        self.methods = methods  # only requests of these HTTP methods count and fail (None: all)
        self.paths = paths  # only requests whose path and query match this regex count and fail (None: all)
        self.log: list[tuple[str, str, str]] = []  # (kind, method, path) of every fault, in order
        self.lock = threading.Lock()
        self.on = False  # faults only while on (set up buckets first, then turn them on)

    def start(self) -> FlakyS3:
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.upstream = (host, port)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.started = time.monotonic()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.moto.stop()

    def faulty(self, on: bool = True) -> None:
        with self.lock:
            self.on, self.started = on, time.monotonic()

    @property
    def storage_options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"connect_timeout": 1, "read_timeout": READ_TIMEOUT_S},
        }

    def location(self, url: str) -> Location:
        """``url`` on this store, reached with `storage_options`."""
        return Location(url, self.storage_options)

    def next_fault(self, method: str, path: str = "") -> str | None:
        with self.lock:
            if self.methods is not None and method not in self.methods:
                return None
            if self.paths is not None and not re.search(self.paths, path):
                return None
            self.requests += 1
            if not self.on or self.requests % self.period or sum(self.faults.values()) >= self.max_faults:
                return None
            if time.monotonic() - self.started > self.seconds:
                return None
            kind = next(self.kinds)
            self.faults[kind] += 1
            self.log.append((kind, method, path))
            return kind


def _handler(s3: FlakyS3) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def handle_one(self) -> None:
            body = self._body()
            fault = s3.next_fault(self.command, self.path)
            if fault == "drop":
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if fault == "stall":
                # Past the read timeout of `storage_options`, so its clients time out; then closed, which
                # a client configured through the environment alone (s3fs's 15 s) meets as a drop.
                time.sleep(STALL_S)
                self.close_connection = True
                return
            if fault in ("503", "500"):
                payload = _SLOW_DOWN if fault == "503" else b""
                self.send_response(int(fault))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            upstream = http.client.HTTPConnection(*s3.upstream, timeout=30)
            try:
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    upstream.putheader(name, value)
                upstream.endheaders()
                if body:
                    upstream.send(body)
                response = upstream.getresponse()
                data = response.read()
            finally:
                upstream.close()
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            # A HEAD's length is the object's, not that of its (empty) body.
            length = response.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _body(self) -> bytes:
            """The request body exactly as sent (chunked framing kept: the headers say so upstream)."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raw = []
                while True:
                    line = self.rfile.readline()
                    raw.append(line)
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while True:  # trailers, then the empty line
                            trailer = self.rfile.readline()
                            raw.append(trailer)
                            if trailer in (b"\r\n", b"\n", b""):
                                return b"".join(raw)
                    raw.append(self.rfile.read(size + 2))
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_one

    return Handler
