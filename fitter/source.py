"""Byte sources for the GGUF header reader: a local file or an HTTP(S) URL read by Range requests.

A source answers `read(offset, n)` and knows its `size`; it counts the bytes it actually fetched
so that callers can report (and tests can bound) what travelled.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from typing import Protocol

from fitter.errors import SourceError


class ByteSource(Protocol):
    name: str
    size: int
    bytes_fetched: int

    def read(self, offset: int, n: int) -> bytes: ...

    def close(self) -> None: ...


class FileSource:
    """A local file, read with pread (no file position shared with anyone)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.name = os.fspath(path)
        try:
            self._fd = os.open(self.name, os.O_RDONLY)
        except FileNotFoundError:
            raise SourceError(f"{self.name}: no such file") from None
        except IsADirectoryError:
            raise SourceError(f"{self.name}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise SourceError(f"{self.name}: cannot open ({e.strerror})") from None
        st = os.fstat(self._fd)
        if not (st.st_mode & 0o170000 == 0o100000):
            os.close(self._fd)
            raise SourceError(f"{self.name}: not a regular file")
        self.size = st.st_size
        self.bytes_fetched = 0

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        data = os.pread(self._fd, n, offset) if n else b""
        self.bytes_fetched += len(data)
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class HttpSource:
    """An http(s) URL read through `Range: bytes=a-b` GETs.

    The size comes from the first ranged response's Content-Range (no separate HEAD needed). A
    server that answers a ranged GET with 200 (the whole body) is refused at once, before its body
    is read: reading a 20 GB model to learn its header is what this class exists to avoid.
    """

    def __init__(self, url: str, timeout: float = 30.0):
        self.name = url
        self.timeout = timeout
        self.bytes_fetched = 0
        self.requests = 0
        self.size = -1
        # The first read learns the size; 64 KiB is enough for most headers' fixed part.
        first = self._get(0, 64 * 1024)
        self._first = first

    def _get(self, offset: int, n: int) -> bytes:
        end = offset + n - 1
        req = urllib.request.Request(
            self.name, headers={"Range": f"bytes={offset}-{end}", "Accept-Encoding": "identity", "User-Agent": "ggfit"}
        )
        self.requests += 1
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and self.size >= 0:
                return b""
            raise SourceError(f"{self.name}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise SourceError(f"{self.name}: cannot fetch ({reason})") from None
        with resp:
            if resp.status != 206:
                raise SourceError(
                    f"{self.name}: the server does not support HTTP Range requests (answered {resp.status} "
                    "to a ranged GET); download the file and pass its path instead"
                )
            m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
            if not m or m.group(3) == "*":
                raise SourceError(f"{self.name}: the server's 206 answer has no usable Content-Range header")
            start, last, total = int(m.group(1)), int(m.group(2)), int(m.group(3))
            if start != offset:
                raise SourceError(f"{self.name}: asked for bytes from {offset}, the server sent from {start}")
            self.size = total
            want = min(last, end) - start + 1
            data = resp.read(want)
        self.bytes_fetched += len(data)
        return data

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        first = self._first
        if first is not None and offset + n <= len(first):
            return first[offset : offset + n]
        return self._get(offset, n)

    def close(self) -> None:
        self._first = None


def open_source(location: str | os.PathLike[str]) -> ByteSource:
    loc = os.fspath(location)
    if loc.startswith(("http://", "https://")):
        return HttpSource(loc)
    if "://" in loc:
        raise SourceError(f"{loc}: unsupported URL scheme (use a path, http:// or https://)")
    return FileSource(loc)
