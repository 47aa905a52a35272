"""Byte sources for the GGUF header reader: a local file or an HTTP(S) URL read by Range requests.

A source answers `read(offset, n)` and knows its `size`; it counts the bytes it actually fetched
so that callers can report (and tests can bound) what travelled.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Protocol

from fitter.errors import SourceError


class ByteSource(Protocol):
    name: str
    size: int
    bytes_fetched: int

    def read(self, offset: int, n: int) -> bytes:
        """Up to n bytes from offset: fewer at the end of the file, and possibly fewer before it
        (callers that need more ask again from where the answer ended; b"" means nothing more)."""
        ...

    def close(self) -> None: ...


class FileSource:
    """A local file, read with pread (no file position shared with anyone)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.name = os.fspath(path)
        self._fd = -1  # close() and __del__ see no descriptor until one is open
        try:
            self._fd = os.open(self.name, os.O_RDONLY)
        except FileNotFoundError:
            raise SourceError(f"{self.name}: no such file") from None
        except IsADirectoryError:
            raise SourceError(f"{self.name}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise SourceError(f"{self.name}: cannot open ({e.strerror})") from None
        except ValueError as e:  # e.g. an embedded NUL byte in the path
            raise SourceError(f"{self.name!r}: not a usable path ({e})") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            if stat.S_ISDIR(st.st_mode):  # Linux opens a directory O_RDONLY without complaint
                raise SourceError(f"{self.name}: is a directory, not a GGUF file")
            raise SourceError(f"{self.name}: not a regular file")
        self.size = st.st_size
        self.bytes_fetched = 0

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        data = os.pread(self._fd, n, offset) if n else b""
        self.bytes_fetched += len(data)
        return data

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except OSError:  # os.close at interpreter exit
            pass


# compiled on first use (re's cache): only a URL's reads parse them, not every command's import
_CONTENT_RANGE = r"bytes\s+(\d+)-(\d+)/(\d+|\*)"
_UNSATISFIED_RANGE = r"bytes\s+\*/(\d+)"


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
        self._first: bytes | None = first

    def _get(self, offset: int, n: int) -> bytes:
        import http.client  # with ssl, ~10 ms: only a URL needs them
        import urllib.error

        try:
            return self._get_checked(offset, n)
        except SourceError:
            raise
        except urllib.error.URLError as e:
            raise SourceError(f"{self.name}: cannot fetch ({e.reason})") from None
        except (http.client.HTTPException, OSError, ValueError) as e:
            # A connection reset or timeout mid-body, a malformed status line or header, a bad URL.
            raise SourceError(f"{self.name}: cannot fetch ({type(e).__name__}: {e})") from None

    def _get_checked(self, offset: int, n: int) -> bytes:
        import urllib.error
        import urllib.request

        end = offset + n - 1
        req = urllib.request.Request(
            self.name, headers={"Range": f"bytes={offset}-{end}", "Accept-Encoding": "identity", "User-Agent": "ggfit"}
        )
        self.requests += 1
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            with e:  # closes the connection without reading the error body
                if e.code == 416:
                    # Past the end; "bytes */N" tells the size (an empty file answers this to bytes=0-...).
                    m = re.match(_UNSATISFIED_RANGE, e.headers.get("Content-Range", "") if e.headers else "")
                    if m:
                        self.size = int(m.group(1))
                    if self.size >= 0:
                        return b""
                raise SourceError(f"{self.name}: HTTP {e.code} {e.reason}") from None
        with resp:  # leaving closes the connection: a body not read is never downloaded further
            if resp.status != 206:
                raise SourceError(
                    f"{self.name}: the server does not support HTTP Range requests (answered {resp.status} "
                    "to a ranged GET); download the file and pass its path instead"
                )
            m = re.match(_CONTENT_RANGE, resp.headers.get("Content-Range", ""))
            if not m or m.group(3) == "*":
                raise SourceError(f"{self.name}: the server's 206 answer has no usable Content-Range header")
            start, last, total = int(m.group(1)), int(m.group(2)), int(m.group(3))
            if start != offset:
                raise SourceError(f"{self.name}: asked for bytes from {offset}, the server sent from {start}")
            if last < start or last >= total:
                raise SourceError(f"{self.name}: the server sent an inconsistent Content-Range {m.group(0)!r}")
            if self.size >= 0 and total != self.size:
                raise SourceError(f"{self.name}: the file changed size while being read ({self.size} then {total} bytes)")
            self.size = total
            want = min(last, end) - start + 1
            data = resp.read(want)
        if not data:
            raise SourceError(f"{self.name}: the connection ended before any of bytes {start}-{start + want - 1} arrived")
        # Fewer bytes than promised (a connection cut mid-body) are returned as they are: the reader
        # asks again from where they end.
        self.bytes_fetched += len(data)
        return data

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        first = self._first
        if first is not None and offset < len(first):
            # What the first answer already holds, even if less than asked: readers ask again for
            # the rest, so a small header costs one request and no bytes twice.
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
