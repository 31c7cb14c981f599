"""The decompressed bytes of a ``.jsonl.zst`` file, frame after frame, noticing a file that ends inside a frame."""

from __future__ import annotations

import io

import zstandard

__all__ = ["ZstdFrames", "TruncatedZstdError"]


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame, that notices a truncated file.

    ``zstandard``'s ``stream_reader`` ends quietly when the input stops inside a frame (a file cut at a block
    boundary reads as a shorter, valid file), so frames are decoded here one ``decompressobj`` at a time:
    input that ends inside a frame raises :class:`TruncatedZstdError`.
    """

    _CHUNK = 1 << 16  # compressed bytes per step (bounds the output of one step)

    def __init__(self, raw: io.BufferedReader) -> None:
        super().__init__()
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # the current frame has consumed input and not ended yet
        self._out = bytearray()
        self.decompressed = 0

    def readable(self) -> bool:
        return True

    def _step(self) -> bool:
        """Decode the next input chunk; False at the end of the input."""
        data = self._raw.read(self._CHUNK)
        if not data:
            if self._in_frame:
                raise TruncatedZstdError(self.decompressed)
            return False
        while data:
            self._in_frame = True
            out = self._frame.decompress(data)
            self._out += out
            self.decompressed += len(out)
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame starts in this chunk
            self._frame = self._dctx.decompressobj()
            self._in_frame = False
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 - a writable buffer (io protocol)
        while not self._out:
            if not self._step():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        del self._out[:n]
        return n


class TruncatedZstdError(Exception):
    """The input of a zstd file ends inside a frame (an interrupted download or copy)."""

    def __init__(self, decompressed: int):
        self.decompressed = decompressed
        super().__init__(f"the data ends inside a zstd frame after {decompressed} decompressed bytes")
