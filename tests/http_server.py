"""A real HTTP server on 127.0.0.1 that serves local files, honours Range requests (or, by `mode`,
misbehaves) and counts the bytes it sends per path. The `server` fixture (tests/conftest.py) runs one."""

from __future__ import annotations

import http.server
import re
import threading
from collections import Counter
from pathlib import Path


class Handler(http.server.BaseHTTPRequestHandler):
    server: "CountingServer"
    CHUNK = 64 * 1024

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        # A small send buffer, so that "bytes sent" means bytes the client could have received.
        import socket

        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)

    def do_GET(self) -> None:
        srv = self.server
        path = self.path.split("?", 1)[0]
        srv.requests.append((path, self.headers.get("Range")))
        try:
            file = srv.files.get(path)
            if srv.mode == "garbage":
                self.wfile.write(b"this is not HTTP\r\n\r\n")
                return
            if file is None:
                self.send_error(404, "Not Found")
                return
            size = file.stat().st_size
            rng = self.headers.get("Range")
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
            if srv.mode == "no-range" or m is None:
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self._send(path, file, 0, size)
                return
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            n = end - start + 1
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            if srv.mode == "half-body":
                n = (n + 1) // 2  # promise n bytes, send half, hang up
            elif srv.mode == "no-body":
                n = 0
            self._send(path, file, start, n)
        finally:
            srv.done.release()

    def _send(self, path: str, file: Path, start: int, n: int) -> None:
        srv = self.server
        with open(file, "rb") as f:
            f.seek(start)
            while n > 0:
                chunk = f.read(min(self.CHUNK, n))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    srv.aborted += 1
                    return
                with srv.lock:
                    srv.sent[path] += len(chunk)
                n -= len(chunk)


class CountingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files: dict[str, Path]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files = files
        self.mode = "range"
        self.sent: Counter[str] = Counter()
        self.requests: list[tuple[str, str | None]] = []
        self.aborted = 0
        self.waited = 0
        self.lock = threading.Lock()
        self.done = threading.Semaphore(0)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def wait_for_handlers(self) -> None:
        """Block until every request seen so far has finished sending (or was cut off)."""
        for _ in range(len(self.requests) - self.waited):
            assert self.done.acquire(timeout=30), "a request handler did not finish"
        self.waited = len(self.requests)

    def reset(self) -> None:
        self.wait_for_handlers()
        self.waited = 0
        self.sent.clear()
        self.requests.clear()
        self.aborted = 0
