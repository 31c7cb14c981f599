"""Packing: documents (token ids) joined with EOS and cut into sequences of exactly L tokens.

Within one source only (the caller keeps one packer per source, so no sequence mixes sources). Every
document is followed by one EOS token; a document longer than L continues into the next sequence. At the
end of a source, the remainder (fewer than L tokens) is dropped and counted as ``dropped_tokens`` in the
manifest: padding would add positions that carry no signal, and a cross-source sequence would break the
per-source accounting.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["Packer", "pack_documents"]


class Packer:
    """Streaming packer; ``carry`` (the tokens not yet in a full sequence) makes it resumable."""

    def __init__(self, *, seq_len: int, eos_id: int, carry: Sequence[int] = ()):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._buf: list[int] = list(carry)

    def add(self, ids: Sequence[int]) -> list[np.ndarray]:
        """Append one document (+ EOS); return the sequences it completed (int64 arrays of length L)."""
        self._buf.extend(ids)
        self._buf.append(self.eos_id)
        return self.drain()

    def drain(self) -> list[np.ndarray]:
        """Full sequences currently buffered (e.g. from a resumed carry)."""
        n = len(self._buf) // self.seq_len
        if n == 0:
            return []
        cut = n * self.seq_len
        arr = np.asarray(self._buf[:cut], dtype=np.int64).reshape(n, self.seq_len)
        del self._buf[:cut]
        return list(arr)

    @property
    def carry(self) -> list[int]:
        """Tokens waiting for the next sequence (always fewer than L after :meth:`add`)."""
        return list(self._buf)


def pack_documents(docs: Iterable[Sequence[int]], *, seq_len: int, eos_id: int) -> tuple[np.ndarray, list[int]]:
    """Pack a whole list of documents: ``(sequences (n, L), dropped remainder)``."""
    packer = Packer(seq_len=seq_len, eos_id=eos_id)
    seqs: list[np.ndarray] = []
    for ids in docs:
        seqs.extend(packer.add(ids))
    out = np.stack(seqs) if seqs else np.zeros((0, seq_len), dtype=np.int64)
    return out, packer.carry
