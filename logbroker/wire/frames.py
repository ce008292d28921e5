"""Length-prefixed frames: ``len:u32 body[len]``.

``FrameDecoder`` keeps its own buffer and checks each length prefix against the maximum before
buffering any of the body, so a peer cannot make the broker hold more than one maximum-size frame
(plus what it has already sent) per connection.
"""

from __future__ import annotations

import struct

from logbroker.wire.errors import FrameTooLargeError

_LENGTH = struct.Struct(">I")
LENGTH_SIZE = _LENGTH.size

#: ``SVC_MAX_FRAME_SIZE``'s default: 16 MiB.
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024


def encode_frame(body: bytes) -> bytes:
    """Prefix ``body`` with its length."""
    return _LENGTH.pack(len(body)) + body


class FrameDecoder:
    """Splits a byte stream into frame bodies, whatever the chunking of the stream."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 0:
            raise ValueError(f"max_frame_size must be >= 0, not {max_frame_size}")
        self._max = max_frame_size
        self._buffer = bytearray()
        self._failed: FrameTooLargeError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the bodies of every frame it completes, in order.

        Raises ``FrameTooLargeError`` at the first length prefix above the maximum; the frames
        this call completed before it are in the error's ``complete_frames``, so pipelined
        requests ahead of the bad frame can still be answered. The decoder then refuses all
        further input.
        """
        if self._failed is not None:
            raise self._failed
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        position = 0
        end = len(buffer)
        while end - position >= LENGTH_SIZE:
            (length,) = _LENGTH.unpack_from(buffer, position)
            if length > self._max:
                buffer.clear()
                self._failed = FrameTooLargeError(length, self._max)
                failure = FrameTooLargeError(length, self._max)
                failure.complete_frames = frames
                raise failure
            start = position + LENGTH_SIZE
            if end - start < length:
                break
            frames.append(bytes(buffer[start : start + length]))
            position = start + length
        if position:
            del buffer[:position]
        return frames
