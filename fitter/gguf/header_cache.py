"""A parsed GGUF header kept on disk, so that reading the same local file again skips the walk.

Reading a big vocabulary's header walks every token and merge string (~500K length-prefixed strings,
40-60 ms in Python); the result is the same until the file changes. An entry is used only when
everything that could change the parse is unchanged:

- the path as given, and the file's device, inode, size, mtime and ctime (ns), from the open
  descriptor (`os.fstat`), so the entry describes the very file being read. ctime cannot be set by a
  user: any write, truncation, `touch -d` or rename onto the path moves it (or the inode);
- ggfit's reader: a digest of the reader's, the header records' and the constants' source, and of gguf-py's
  constants.

A file whose ctime is less than `RACY_NS` old when it is read is not stored ("racily clean", as git
calls it): it could still change within the clock tick that stamped it, without its times moving. A
file that changed while it was read (fstat differs before and after) is not stored either.

Entries are `${GGFIT_CACHE:-~/.cache/ggfit}/headers/<hash of the path as given>.pkl`: one per path,
a changed or replaced file replaces its entry. An entry is a magic line, a CRC-32 and Adler-32 of the rest, and a pickle
of (key, the header as plain values) read by an unpickler that builds no class; anything else (a
truncated, corrupt or foreign entry, a stale key) is a miss, never an error. Writes go through a
temporary file and `os.replace`; a cache that cannot be written is skipped silently.

Off unless enabled: `ggfit`'s command line turns it on (`with enabled(): ...`); library callers and
tests read the file every time unless they opt in. `GGFIT_NO_HEADER_CACHE=1` turns it off everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import time
import zlib
from collections.abc import Iterator
from typing import Any

from fitter.cache import CACHES, cache_root

MAGIC = b"ggfit-header-cache 3\n"
RACY_NS = 2_000_000_000  # a file changed less than this before it is read is not stored
_DIGEST = 8


class _State:
    """Whether the cache is used here (`enabled`), and the reader's code digest once worked out (_code_fingerprint).
    Kept in fitter.cache.CACHES: clearing it turns the cache off and forgets the digest."""

    __slots__ = ("on", "fingerprint")

    def __init__(self) -> None:
        self.on = False
        self.fingerprint: bytes | None = None

    def clear(self) -> None:
        self.on = False
        self.fingerprint = None


_STATE = CACHES.keep(_State(), "headers")


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Use (and fill) the on-disk header cache inside this block."""
    before = _STATE.on
    _STATE.on = on and not os.environ.get("GGFIT_NO_HEADER_CACHE")
    try:
        yield
    finally:
        _STATE.on = before


def is_enabled() -> bool:
    return _STATE.on


def cache_dir() -> str:
    return os.path.join(cache_root(), "headers")


def _code_fingerprint() -> bytes:
    """The reader's own code (read as files: the reader imports this module): an entry written by another reader is a
    miss."""
    if _STATE.fingerprint is None:
        from fitter.gguf import constants, header

        here = os.path.dirname(__file__)
        parts = [MAGIC]
        for path in (os.path.join(here, "reader.py"), os.path.join(here, "cursor.py"), header.__file__,
                     constants.__file__, __file__, constants.SOURCE):
            if path:
                with open(path, "rb") as f:
                    parts.append(f.read())
        _STATE.fingerprint = _digest(b"\0".join(parts))
    return _STATE.fingerprint


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _digest(data: bytes | memoryview) -> bytes:
    """CRC-32 and Adler-32 (zlib, already loaded: hashlib would load OpenSSL, ~1 ms): an entry's check
    against a torn or corrupt write, not a secret (the key inside is compared in full)."""
    return zlib.crc32(data).to_bytes(4, "little") + zlib.adler32(data).to_bytes(4, "little")


def _entry_path(location: str, shard: int) -> str:
    name = _digest(f"{location}\0{shard}".encode("utf-8", "surrogateescape")).hex()
    return os.path.join(cache_dir(), name + ".pkl")


def _key(location: str, shard: int, st: os.stat_result) -> tuple:
    return (location, shard, _stat_key(st), _code_fingerprint())


class _Unpickler(pickle.Unpickler):
    """Builds nothing but the standard containers: an entry naming any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: a header cache entry holds plain values only")


_SKIPPED_ARRAY, _SKIPPED_STRING = "\0skipped array", "\0skipped string"  # tags of the two summaries


# the reader's classes as _encode / _decode know them: a class that gains a field is neither stored nor loaded
_LAYOUT = {"GGUFHeader": ("metadata", "tensors", "shards", "value_types", "key_offsets"),
           "TensorInfo": ("name", "shape", "ggml_type", "offset", "nbytes", "shard")}


def _check_layout() -> None:
    from fitter.gguf.header import GGUFHeader, TensorInfo

    for cls, names in ((GGUFHeader, tuple(GGUFHeader.model_fields)),  # (a Record: not made a dataclass to ask)
                       (TensorInfo, tuple(f.name for f in dataclasses.fields(TensorInfo)))):
        if names != _LAYOUT[cls.__name__]:
            raise TypeError(f"{cls.__name__} changed: the header cache does not know its fields")


def _encode(header: Any) -> tuple:
    """A header as plain values (pickling the enums by reference would import the gguf package, numpy and all)."""
    from fitter.gguf.header import SkippedArray, SkippedString

    _check_layout()

    def value(v: Any) -> Any:
        if isinstance(v, SkippedArray):
            return (_SKIPPED_ARRAY, int(v.type), v.length)
        if isinstance(v, SkippedString):
            return (_SKIPPED_STRING, v.length)
        return v

    return (
        [(k, value(v)) for k, v in header.metadata.items()],
        [(t.name, t.shape, int(t.ggml_type), t.offset, t.nbytes, t.shard) for t in header.tensors],
        [[getattr(s, f) for f in s.model_fields] for s in header.shards],
        [(k, int(v)) for k, v in header.value_types.items()],
        list(header.key_offsets.items()),
    )


def _decode(plain: tuple) -> Any:
    from fitter.gguf.header import (
        _GGML_TYPE_BY_ID,
        _VALUE_TYPE_BY_ID,
        GGUFHeader,
        ShardInfo,
        SkippedArray,
        SkippedString,
        TensorInfo,
    )

    def value(v: Any) -> Any:
        if type(v) is tuple:
            if v[0] == _SKIPPED_ARRAY:
                return SkippedArray(_VALUE_TYPE_BY_ID[v[1]], v[2])
            if v[0] == _SKIPPED_STRING:
                return SkippedString(v[1])
            raise ValueError("not a header cache value")
        return v

    _check_layout()
    metadata, tensors, shards, value_types, key_offsets = plain
    return GGUFHeader(
        {k: value(v) for k, v in metadata},
        [TensorInfo(name, tuple(shape), _GGML_TYPE_BY_ID[t], offset, nbytes, shard)
         for name, shape, t, offset, nbytes, shard in tensors],
        [ShardInfo(*s) for s in shards],
        {k: _VALUE_TYPE_BY_ID[v] for k, v in value_types},
        dict(key_offsets),
    )


def load(location: str, shard: int, st: os.stat_result) -> Any | None:
    """The cached header of this file as it is now (`st`: its fstat), or None."""
    try:
        with open(_entry_path(location, shard), "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        if not data.startswith(MAGIC):
            return None
        digest = data[len(MAGIC):len(MAGIC) + _DIGEST]
        payload = memoryview(data)[len(MAGIC) + _DIGEST:]
        if _digest(payload) != digest:
            return None
        key, plain = _Unpickler(io.BytesIO(payload)).load()
        if key != _key(location, shard, st):
            return None
        return _decode(plain)
    except Exception:  # a corrupt or foreign entry is a miss, whatever the unpickler or the decoder says
        return None


def store(location: str, shard: int, before: os.stat_result, after: os.stat_result, header: Any) -> None:
    """Keep the header read between two fstats of the file, if the file held still and is not racily new."""
    if _stat_key(before) != _stat_key(after) or time.time_ns() - after.st_ctime_ns < RACY_NS:
        return
    tmp = None
    try:
        payload = pickle.dumps((_key(location, shard, after), _encode(header)), protocol=pickle.HIGHEST_PROTOCOL)
        path = _entry_path(location, shard)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + _digest(payload) + payload)
        os.replace(tmp, path)
    except Exception:  # a cache that cannot be written (read-only, full, unpicklable) is skipped
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
