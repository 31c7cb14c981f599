"""Tokenizers: load a local HF tokenizer (directory or tokenizer.json) or train a byte-level BPE.

Training is deterministic for a given document sequence and settings (test: two trainings give
byte-identical ``tokenizer.json``). The fingerprint of a tokenizer is the sha256 of its
``tokenizer.json``; it is written into every manifest and checked against models and shards.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.storage import tokenizer_json_path
from schemas.manifest import sha256_file

__all__ = ["LoadedTokenizer", "TextRefused", "load_tokenizer", "shared_tokenizer", "share_tokenizer",
           "train_bpe_tokenizer", "PIECE_CHARS"]

#: Documents longer than this many characters are tokenized piece by piece (see ``encode_pieces``).
PIECE_CHARS = 1 << 18
# A space between two letters: every pre-tokenizer in use (byte-level GPT-2 / Llama-3 regexes, Metaspace,
# whitespace splitting) starts a new pre-token at such a space, and BPE never merges across pre-tokens,
# so cutting a text there gives the same ids as encoding it whole.
_SAFE_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")


class TextRefused(ValueError):
    """The tokenizer refused a text (``str(e)``: why, in its own words). The readers refuse the one known kind, a
    lone surrogate, before it gets here (:func:`curation.ingest.jsonstream.lone_surrogate`); ``prepare`` makes any
    other refusal a bad record naming the document's file and line."""


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list:
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=False)
    except Exception as e:  # tokenizers raises TypeError (a string it cannot take), or its own Exception
        raise TextRefused(f"the tokenizer cannot encode it ({type(e).__name__}: {str(e)[:200]})") from None


@dataclass
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer`` with the facts the pipeline needs."""

    tokenizer: Tokenizer
    path: str  # the tokenizer.json it was loaded from
    eos_id: int
    vocab_size: int  # including added/special tokens: every id is < vocab_size
    fingerprint: str  # sha256 of tokenizer.json

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (no special tokens added).

        Raises:
            TextRefused: the tokenizer refused one of the texts.
        """
        return [e.ids for e in _encode(self.tokenizer, texts)]

    def encode_pieces(self, text: str, *, piece_chars: int = PIECE_CHARS, at_once: int = 1) -> Iterator[np.ndarray]:
        """The ids of ``text`` as a sequence of arrays, encoding about ``piece_chars`` characters at once
        (``at_once`` such pieces together, on the tokenizer's threads).

        Encoding one huge document whole costs the tokenizer ~150 bytes per character (a 17 MB document
        takes 2.7 GB); pieces keep that bounded. Pieces are cut at a space between two letters (searched
        from ``piece_chars`` on; a text without one is encoded whole), where the pre-tokenizers we use
        always split, so the concatenated ids equal ``encode_batch([text])[0]`` (tested for the trained
        byte-level BPE and GPT-2's tokenizer).
        """
        return self.encode_stream((text,), piece_chars=piece_chars, at_once=at_once)

    def encode_stream(self, pieces: Iterable[str], *, piece_chars: int = PIECE_CHARS, at_once: int = 1,
                      ) -> Iterator[np.ndarray]:
        """:meth:`encode_pieces` of the concatenation of ``pieces`` (any sizes), never holding it whole: the text is
        cut exactly where ``encode_pieces`` cuts it (the first safe cut from ``piece_chars`` on; it holds about
        ``piece_chars`` characters plus a few more up to that cut, more only for a text without one), so the ids
        are the same."""
        group: list[str] = []
        for piece in _cut_stream(iter(pieces), piece_chars):
            group.append(piece)
            if len(group) == at_once:
                for enc in _encode(self.tokenizer, group):
                    yield np.asarray(enc.ids, dtype=np.int64)
                group = []
        if group:
            for enc in _encode(self.tokenizer, group):
                yield np.asarray(enc.ids, dtype=np.int64)


def _cut_stream(pieces: Iterator[str], piece_chars: int) -> Iterator[str]:
    """The text of ``pieces`` cut where :meth:`LoadedTokenizer.encode_pieces` cuts the whole text. ``buf`` is the text
    from the current cut on: a cut needs more than ``piece_chars`` characters of it, and a match of ``_SAFE_CUT``
    whose letter after the space has arrived (one ending at the buffer's end may only be completed by more)."""
    buf, at, more = "", 0, True  # the text from the current cut on is buf[at:]: a cut moves ``at``, never copies
    while True:
        while more and len(buf) - at <= piece_chars:
            nxt = next(pieces, None)
            more = nxt is not None
            if nxt:  # the text so far is short here: dropping what was cut off copies little
                buf, at = buf[at:] + nxt, 0
        if len(buf) - at <= piece_chars:  # the end: the rest is the last piece
            if len(buf) > at:
                yield buf[at:]
            return
        m = _SAFE_CUT.search(buf, at + piece_chars)
        while m is None and more:
            nxt = next(pieces, None)
            more = nxt is not None
            if nxt:
                searched = len(buf) - 1 - at  # a space at the old end may now have its letter after it
                buf, at = buf[at:] + nxt, 0
                m = _SAFE_CUT.search(buf, max(piece_chars, searched))
        if m is None:  # no safe cut in the rest: encoded whole, as encode_pieces does
            yield buf[at:]
            return
        yield buf[at:m.start()]
        at = m.start()


def load_tokenizer(path: str, *, eos_token: str = "<|endoftext|>") -> LoadedTokenizer:
    """Load a tokenizer.json (or a directory holding one); ``eos_token`` must be in its vocabulary."""
    json_path = tokenizer_json_path(path)
    try:
        tok = Tokenizer.from_file(json_path)
    except Exception as e:  # tokenizers raises a plain Exception with the serde message
        raise ValueError(f"{json_path}: not a valid tokenizer.json ({e})") from e
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(
            f"{json_path}: EOS token {eos_token!r} is not in the vocabulary; set tokenizer.eos_token"
        )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return LoadedTokenizer(tok, json_path, eos_id, vocab, sha256_file(json_path))


#: Tokenizers loaded in this process, by (tokenizer.json, EOS token, sha256): see :func:`shared_tokenizer`.
_SHARED: dict[tuple[str, str, str], LoadedTokenizer] = {}


def share_tokenizer(tok: LoadedTokenizer, *, eos_token: str) -> None:
    """Let :func:`shared_tokenizer` return ``tok`` (already loaded in this process) instead of loading it again
    (one tokenizer at a time: the one of the run in progress)."""
    _SHARED.clear()
    _SHARED[(os.path.abspath(tok.path), eos_token, tok.fingerprint)] = tok


def shared_tokenizer(path: str, *, eos_token: str, fingerprint: str) -> LoadedTokenizer:
    """The tokenizer at ``path``, loaded once per process (the work units of a run share it).

    Raises:
        ValueError: the file is no longer the one the run started with (``fingerprint``, its sha256).
    """
    key = (os.path.abspath(path), eos_token, fingerprint)
    if key not in _SHARED:
        storage.fetch(path)  # one saved into an object-store output_dir: from the bucket on another node
        tok = load_tokenizer(path, eos_token=eos_token)
        if tok.fingerprint != fingerprint:
            raise ValueError(f"{tok.path}: the tokenizer changed while preparing (sha256 {tok.fingerprint[:12]}…, the "
                             f"run started with {fingerprint[:12]}…); restore it, or prepare into a new output_dir")
        share_tokenizer(tok, eos_token=eos_token)
    return _SHARED[key]


def train_bpe_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int,
    min_frequency: int = 2,
    eos_token: str = "<|endoftext|>",
    save_to: str,
) -> LoadedTokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` and save it (atomically) to ``save_to``.

    The EOS token gets id 0. Byte-level means every string is encodable (no unknown token).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(save_to)), exist_ok=True)
    atomic_write_text(save_to, tok.to_str(pretty=True))
    return load_tokenizer(save_to, eos_token=eos_token)
