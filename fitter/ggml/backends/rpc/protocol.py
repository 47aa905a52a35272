"""Ask an rpc-server for its devices' memory over llama.cpp's RPC protocol (ggml-rpc.cpp, protocol 7.x), as
`--budget auto` with `--rpc` needs: HELLO (negotiate_hello), DEVICE_COUNT (ggml_backend_rpc_get_device_count),
then per device GET_DEVICE_MEMORY (ggml_backend_rpc_get_device_memory) and the default buffer type's
GET_ALIGNMENT / GET_MAX_SIZE (what ggml_backend_rpc_buffer_type asks once): the alignment says the server's backend
(CUDA's buffer type 128, the CPU's 32) and the max size tells a Mac's Metal (32 too, but maxBufferLength where the
CPU's is SIZE_MAX). One TCP connection per server, a timeout on every step; a server that does
not answer raises RPCError with the endpoint in its message."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from fitter.errors import GGFitError

RPC_CMD_GET_ALIGNMENT = 1
RPC_CMD_GET_MAX_SIZE = 2
RPC_CMD_GET_DEVICE_MEMORY = 11
RPC_CMD_HELLO = 14
RPC_CMD_DEVICE_COUNT = 15
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
RPC_CONN_CAPS_SIZE = 24  # transport.h: all zero, no RDMA offered


class RPCError(GGFitError):
    """An --rpc endpoint that is malformed, does not answer, or speaks another protocol version."""


class RemoteDevice(NamedTuple):
    endpoint: str  # HOST:PORT as --rpc gives it
    device: int  # the device's number on its server (its buffer type is RPC<device>[endpoint])
    free: int
    total: int
    alignment: int = 32  # RPC_CMD_GET_ALIGNMENT of the device's default buffer type
    max_size: int = 2**64 - 1  # RPC_CMD_GET_MAX_SIZE

    @property
    def backend(self) -> str:
        """The server's backend in llama.cpp's registry names, by its buffer type's alignment and max size: CUDA's
        128 (ggml_backend_cuda_buffer_type_get_alignment); 32 and a finite max size, Metal's (MTL:
        ggml_backend_metal_buffer_type_shared_get_max_size, the device's maxBufferLength); else the CPU's (32, no
        get_max_size: SIZE_MAX). fitter.ggml.backends.rpc.remote."""
        if self.alignment == 128:
            return "CUDA"
        return "MTL" if self.alignment == 32 and self.max_size < 2**64 - 1 else "CPU"

    @property
    def memory_note(self) -> str:
        """What the server's free memory is (ggml_backend_dev_memory on its device), for --budget auto's note."""
        return {"CUDA": "cudaMemGetInfo's free VRAM on the server",
                "MTL": "the Mac's recommendedMaxWorkingSetSize less what Metal holds (ggml_metal_device_get_memory)"
                }.get(self.backend, "a CPU rpc-server reports all its RAM as free")


def parse_endpoints(text: str) -> list[str]:
    """--rpc's comma-separated HOST:PORT list (common/arg.cpp add_rpc_devices, parse_endpoint)."""
    out = []
    for ep in (s.strip() for s in text.split(",")):
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RPCError(f"--rpc {text}: '{ep}' is not HOST:PORT")
        out.append(ep)
    if not out:
        raise RPCError("--rpc: no RPC servers specified")
    return out


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return buf


def _call(sock: socket.socket, cmd: int, payload: bytes, answer: int) -> bytes:
    """send_rpc_cmd: cmd byte | u64 size | payload; the answer is u64 size | payload of exactly `answer` bytes."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv(sock, 8))
    if size != answer:
        raise ConnectionError(f"command {cmd}: answer of {size} bytes, expected {answer}")
    return _recv(sock, answer)


def query_server(endpoint: str, timeout: float = 5.0) -> list[RemoteDevice]:
    """Every device one rpc-server offers, with its free and total memory."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            major, minor, patch = struct.unpack("<BBB", _call(sock, RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE),
                                                              4 + RPC_CONN_CAPS_SIZE)[:3])
            if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
                raise RPCError(f"--rpc {endpoint}: the server speaks RPC protocol {major}.{minor}.{patch}, llama.cpp "
                               f"here {RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION}.x")
            (count,) = struct.unpack("<I", _call(sock, RPC_CMD_DEVICE_COUNT, b"", 4))
            out = []
            for i in range(count):
                dev = struct.pack("<I", i)
                free, total = struct.unpack("<QQ", _call(sock, RPC_CMD_GET_DEVICE_MEMORY, dev, 16))
                (align,) = struct.unpack("<Q", _call(sock, RPC_CMD_GET_ALIGNMENT, dev, 8))
                (max_size,) = struct.unpack("<Q", _call(sock, RPC_CMD_GET_MAX_SIZE, dev, 8))
                out.append(RemoteDevice(endpoint, i, free, total, align, max_size))
            return out
    except (OSError, ConnectionError, struct.error) as e:
        why = "no answer" if isinstance(e, socket.timeout) else str(e) or type(e).__name__
        raise RPCError(f"--rpc {endpoint}: the rpc-server does not answer ({why}); start it there "
                       f"(rpc-server -H 0.0.0.0 -p {port}) or leave it out") from None


def query_devices(endpoints: list[str], timeout: float = 5.0) -> list[RemoteDevice]:
    """The RPC devices llama.cpp would register for these endpoints, in its order (RPC0, RPC1, ...)."""
    return [d for ep in endpoints for d in query_server(ep, timeout)]
