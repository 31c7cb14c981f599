"""What a work unit of ``prepare`` reads, as it packs it: its documents (or token records) in input order, in encode
batches, each one a :class:`Doc` whose token ids come in pieces (a huge text is tokenized while it is packed), or the
bad record it is (one the reader refuses, or a text the tokenizer refuses, named by file and line)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from curation.ingest.corpus import BadRecordError, Document, FileSpan, iter_documents
from curation.ingest.token_sources import TokenRecord, iter_token_records
from curation.ingest.tokenizer import LoadedTokenizer, TextRefused
from schemas.config import SourceConfig

__all__ = ["read_documents", "batches", "Doc", "documents"]

#: An encode batch: at most this many records and about this many characters (a huge document ends its batch).
_ENCODE_BATCH = 256
_BATCH_CHARS = 1 << 20


def read_documents(source: SourceConfig, spans: list[FileSpan], skip_bad: bool, *, start_file: int = 0,
                   start_record: int = 0, vocab_size: int | None = None,
                   ) -> Iterator[Document | TokenRecord | BadRecordError]:
    """A source's documents in ``spans`` (a pre-tokenized source's token records, whole inputs, their ids checked
    against ``vocab_size``) from a resume position; bad records raise unless ``skip_bad`` (then they are yielded
    to count). ``skip_documents`` are skipped when reading from the start."""
    at_start = start_file == 0 and start_record == 0
    to_skip = source.skip_documents if at_start else 0  # a resume position is already past them
    if source.pre_tokenized:
        assert vocab_size is not None, "token records are checked against the tokenizer's vocabulary"
        items = iter_token_records(source, files=[s.path for s in spans], vocab_size=vocab_size,
                                   start_file=start_file, start_record=start_record)
    else:
        items = iter_documents(source, spans=spans, start_file=start_file, start_record=start_record, stream=True)
    for item in items:
        if to_skip:
            to_skip -= not isinstance(item, BadRecordError)
            continue
        if isinstance(item, BadRecordError) and not skip_bad:
            raise item
        yield item


def batches(items: Iterator[Document | TokenRecord | BadRecordError],
             ) -> Iterator[list[Document | TokenRecord | BadRecordError]]:
    """Items in encode batches of at most ``_ENCODE_BATCH`` records and about ``_BATCH_CHARS`` characters (or
    bytes of token ids: a huge document or record ends its batch, so at most one is held at a time)."""
    batch: list[Document | TokenRecord | BadRecordError] = []
    chars = 0
    for item in items:
        batch.append(item)
        if isinstance(item, Document):
            chars += _BATCH_CHARS if item.stream is not None else len(item.text)
        elif isinstance(item, TokenRecord):
            chars += item.ids.nbytes
        if len(batch) >= _ENCODE_BATCH or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@dataclass
class Doc:
    """One document ready to pack, whatever it was read as: its reader position, its token ids in pieces (made
    lazily: a huge text is tokenized while it is packed), and whether an EOS follows it."""

    position: tuple[int, int]  # (file index, record index) of the document: where a resume reads it again
    pieces: Iterable[np.ndarray]
    eos: bool
    file: str
    line: Callable[[], int]  # its line (counted when needed: a tokenizer refusing it)


def documents(batch: list[Document | TokenRecord | BadRecordError], tok: LoadedTokenizer, source: SourceConfig, *,
              piece_chars: int, at_once: int) -> Iterator[Doc | BadRecordError]:
    """The items of ``batch`` in input order as :class:`Doc` s, or the bad record each one is (read as one, or a
    text the tokenizer refuses). Short texts (at most ``piece_chars`` characters) are encoded together (on the
    tokenizer's threads), longer ones in pieces of about ``piece_chars``, ``at_once`` pieces together."""
    short = [d for d in batch if isinstance(d, Document) and d.stream is None and len(d.text) <= piece_chars]
    encoded = iter(_encode_short(tok, short))
    for item in batch:
        if isinstance(item, BadRecordError):
            yield item
            continue
        position = (item.file_index, item.next_record - 1)
        if isinstance(item, TokenRecord):  # ids as they are; a stream's pieces hold their own EOS
            yield Doc(position, [item.ids], source.token_rows == "documents", item.file, lambda i=item: i.line)
            continue
        if item.stream is not None:  # a huge line's text, decoded piece by piece (curation.ingest.jsonstream)
            pieces: Iterable[np.ndarray] | BadRecordError = tok.encode_stream(
                item.pieces(), piece_chars=piece_chars, at_once=at_once)
        elif len(item.text) > piece_chars:
            pieces = tok.encode_pieces(item.text, piece_chars=piece_chars, at_once=at_once)
        else:
            ids = next(encoded)
            pieces = ids if isinstance(ids, BadRecordError) else [ids]
        yield pieces if isinstance(pieces, BadRecordError) else Doc(
            position, pieces, True, item.file, lambda i=item: i.line)


def _encode_short(tok: LoadedTokenizer, docs: list[Document]) -> list[np.ndarray | BadRecordError]:
    """The ids of each short document, encoded together; a text the tokenizer refuses is a bad record naming its
    file and line (the batch is then encoded one document at a time, to know which)."""
    try:
        return [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch([d.text for d in docs])]
    except TextRefused:
        out: list[np.ndarray | BadRecordError] = []
        for d in docs:
            try:
                out.append(np.asarray(tok.encode_batch([d.text])[0], dtype=np.int64))
            except TextRefused as e:
                out.append(BadRecordError(d.file, d.line, str(e)))
        return out
