"""Packing: documents (token ids) joined with EOS and cut into sequences of exactly L tokens.

Within one work unit only (``curation.ingest.units``: the caller keeps one packer per unit, so no sequence
mixes sources or units). Every document is followed by one EOS token; a document longer than L continues into
the next sequence. At the end of a unit, the remainder (fewer than L tokens) is dropped and counted as
``dropped_tokens`` in the manifest: padding would add positions that carry no signal, a cross-source sequence
would break the per-source accounting, and a cross-unit one would make a unit's output depend on others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["Packer", "pack_documents"]


class Packer:
    """Streaming packer; ``carry`` (the tokens not yet in a full sequence) makes it resumable.

    A document may be fed in pieces (:meth:`extend`, then ``extend([eos_id])``), so a huge document is
    never held as one token list: only the fewer-than-L tokens of an unfinished sequence stay buffered.
    """

    def __init__(self, *, seq_len: int, eos_id: int, carry: Sequence[int] = ()):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._buf = np.asarray(carry, dtype=np.int64).reshape(-1)

    def extend(self, ids: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Append tokens (part of a document, no EOS); return the sequences they completed."""
        self._buf = np.concatenate([self._buf, np.asarray(ids, dtype=np.int64).reshape(-1)])
        return self.drain()

    def add(self, ids: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Append one document (+ EOS); return the sequences it completed (int64 arrays of length L)."""
        return self.extend(np.append(np.asarray(ids, dtype=np.int64), self.eos_id))

    def drain(self) -> list[np.ndarray]:
        """Full sequences currently buffered (e.g. from a resumed carry)."""
        n = len(self._buf) // self.seq_len
        if n == 0:
            return []
        cut = n * self.seq_len
        full, self._buf = self._buf[:cut].reshape(n, self.seq_len), self._buf[cut:].copy()
        return list(full)

    @property
    def carry(self) -> list[int]:
        """Tokens waiting for the next sequence (always fewer than L after :meth:`add`)."""
        return self._buf.tolist()


def pack_documents(docs: Iterable[Sequence[int]], *, seq_len: int, eos_id: int) -> tuple[np.ndarray, list[int]]:
    """Pack a whole list of documents: ``(sequences (n, L), dropped remainder)``."""
    packer = Packer(seq_len=seq_len, eos_id=eos_id)
    seqs: list[np.ndarray] = []
    for ids in docs:
        seqs.extend(packer.add(ids))
    out = np.stack(seqs) if seqs else np.zeros((0, seq_len), dtype=np.int64)
    return out, packer.carry
