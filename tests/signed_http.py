"""A loopback store of signed URLs: an HTTP server on 127.0.0.1 that serves the files of one directory only
to requests carrying its current signature in the query string (``?se=...&sig=...``, as an S3 presigned
URL or an Azure SAS does), and `resign` makes a new one, after which the old signature is refused
(403), as an expired one is. HEAD and GET with byte ranges, as fsspec's HTTP filesystem reads."""

from __future__ import annotations

import itertools
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class SignedStore:
    """Start with `start`, stop with `stop`; `url(name)` is the signed URL of a file of ``root`` now."""

    def __init__(self, root: Path):
        self.root = root
        self.signatures = itertools.count(1)
        self.sig = ""
        self.refused = 0  # requests refused for a missing or stale signature
        self.resign()

    def resign(self) -> None:
        """A new signature; URLs signed with the one before are refused from now on."""
        self.sig = f"signature{next(self.signatures):04d}"

    def url(self, name: str) -> str:
        return f"{self.base}/data/{name}?se=2099-01-01&sp=r&sig={self.sig}"

    def start(self) -> SignedStore:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(store: SignedStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def answer(self, *, body: bool) -> None:
            parts = urlsplit(self.path)
            if parse_qs(parts.query).get("sig") != [store.sig]:
                store.refused += 1
                self.send_error(403, "signature missing or expired")
                return
            path = store.root / parts.path.removeprefix("/data/")
            if not parts.path.startswith("/data/") or not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            lo, hi, status = 0, len(data), 200
            match = _RANGE.match(self.headers.get("Range", ""))
            if match:
                lo = int(match.group(1))
                hi = min(int(match.group(2)) + 1, len(data)) if match.group(2) else len(data)
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(hi - lo))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[lo:hi])

    return Handler
