"""Length-prefixed frames: how our processes talk to the processes they start.

One frame is a 4-byte big-endian length and that many bytes. The tensor-parallel link
(actors/tp/link.py) reads and writes them over a follower's pipes with blocking calls; the
isolated engine's link (actors/isolate/link.py) over a socket pair, from trio. What a frame's
bytes mean is each link's own business (a pickle between ranks of one program; plain data to and
from an isolated engine). A frame is at most 4 GiB - 1 (the largest a request's images take is
3 GiB: docs/operations.md, `--media-request-memory`).
"""

from __future__ import annotations

import struct
from typing import IO

HEADER = struct.Struct(">I")
MAX_FRAME = 2**32 - 1


def pack(payload: bytes) -> bytes:
    """`payload` as one frame."""
    if len(payload) > MAX_FRAME:
        raise ValueError(f"a frame of {len(payload)} bytes is over the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(payload)) + payload


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(pack(payload))
    stream.flush()


def read_frame(stream: IO[bytes]) -> bytes:
    """The next frame's bytes from a blocking stream; EOFError when the other end closed."""
    header = read_exactly(stream, HEADER.size)
    return read_exactly(stream, HEADER.unpack(header)[0])


def read_exactly(stream: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the other end closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class FrameBuffer:
    """Whole frames out of bytes as they arrive (a socket's reads cut frames anywhere)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes | bytearray) -> list[bytes]:
        """The frames `data` completes, in order."""
        self._data += data
        frames = []
        while len(self._data) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._data)
            end = HEADER.size + size
            if len(self._data) < end:
                break
            frames.append(bytes(self._data[HEADER.size : end]))
            del self._data[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._data)
