"""The shard protocol's framing: a small binary format over one TCP connection.

Why not HTTP+JSON like the master: a push of a few thousand rows is a few hundred KB of float32,
and JSON would turn it into text and back on every minibatch. Every message, either way:

    magic "ESP1" | u32 header length | u64 body length   (little-endian)
    header: UTF-8 JSON object (op, token, epoch, table, counts, ...)
    body:   raw little-endian arrays the header describes (int64 ids, then float32 rows)

Nothing is unpickled: a header is JSON, a body is read with np.frombuffer at the dtype the
protocol fixes. Sizes are bounded before anything is allocated.

Every request carries the job's token in its header; whatever listens on a shard's address (the
shard, or a resumed shard pod waiting for its cut) reads the token from the file it was given
(`read_token`) and answers a request without it UNAUTHORIZED (`authorized`).
"""

from __future__ import annotations

import hmac
import json
import socket
import struct

import numpy as np

from elastic_step.ps.api import Status

MAGIC = b"ESP1"
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 64 * 1024
MAX_BODY = 1 << 30


class FrameError(ValueError):
    """A message that does not follow the framing (wrong magic, oversized, truncated)."""


def send(sock: socket.socket, header: dict, *arrays: np.ndarray) -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays]
    body_len = sum(len(p) for p in parts)
    sock.sendall(b"".join([_PREFIX.pack(MAGIC, len(head), body_len), head, *parts]))


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-message" if got else "the peer closed the connection")
        got += n
    return buffer


def receive(sock: socket.socket) -> tuple[dict, bytearray]:
    magic, head_len, body_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if magic != MAGIC or head_len > MAX_HEADER or body_len > MAX_BODY:
        raise FrameError("not a shard protocol message, or one over the size limits")
    header = json.loads(_recv_exact(sock, head_len))
    if not isinstance(header, dict):
        raise FrameError("a message header must be a JSON object")
    return header, _recv_exact(sock, body_len)


def read_token(path: str) -> str:
    """The job token from its file (a token never travels on a command line). ValueError when the
    file is empty: an empty token would let any request in."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def authorized(sock: socket.socket, header: dict, token: bytes) -> bool:
    """Whether a request's header carries the job's `token`; if not, it is answered UNAUTHORIZED
    and the caller closes the connection."""
    if hmac.compare_digest(str(header.get("token", "")).encode(), token):
        return True
    send(sock, {"status": Status.UNAUTHORIZED, "detail": "missing or wrong job token"})
    return False


def ids_and_rows(body: bytearray, count: int, dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Split a body into `count` int64 ids and, when it carries them, count x dim float32 rows."""
    id_bytes = 8 * count
    if len(body) not in (id_bytes, id_bytes + 4 * count * dim):
        raise FrameError(f"body of {len(body)} bytes does not hold {count} ids (and rows of dim {dim})")
    ids = np.frombuffer(body, dtype="<i8", count=count)
    if len(body) == id_bytes:
        return ids, None
    return ids, np.frombuffer(body, dtype="<f4", offset=id_bytes).reshape(count, dim)


# Named arrays in one body (a move's rows and keys): the header lists [name, dtype, shape] of
# each in order. Only these dtypes: nothing but plain numbers is ever read from a body.
ARRAY_DTYPES = frozenset({"<i8", "<f4", "<u4", "|b1"})


def pack(arrays: dict[str, np.ndarray]) -> tuple[list, tuple[np.ndarray, ...]]:
    """(the header's list describing `arrays`, the arrays to send) for `unpack` to read back."""
    spec, out = [], []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.newbyteorder("<").str if array.dtype.kind in "iuf" else array.dtype.str
        spec.append([name, dtype, list(array.shape)])
        out.append(array.astype(dtype, copy=False))
    return spec, tuple(out)


def unpack(spec: list, body: bytearray) -> dict[str, np.ndarray]:
    arrays, offset = {}, 0
    for name, dtype, shape in spec:
        if dtype not in ARRAY_DTYPES or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise FrameError(f"array {str(name)[:64]!r}: dtype {dtype!r} or shape {shape!r} is not allowed")
        count = int(np.prod(shape, dtype=np.int64))
        size = count * np.dtype(dtype).itemsize
        if offset + size > len(body):
            raise FrameError(f"array {str(name)[:64]!r} runs past the body")
        arrays[str(name)] = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset += size
    if offset != len(body):
        raise FrameError("the body holds more than its arrays")
    return arrays
