"""Corpus preparation: named sources → tokenized, packed, zstd MDS candidate (and validation) shards.

Text sources are read by :mod:`curation.ingest.corpus` and tokenized here; pre-tokenized ones (MDS token
datasets, parquet/arrow token columns) by :mod:`curation.ingest.token_sources`, whose records' ids are packed
as they are (``token_rows: stream``) or each followed by EOS like a text document (``token_rows: documents``).

Layout of ``output_dir``::

    tokenizer/tokenizer.json          (trained here, or a copy of nothing: a given tokenizer stays where it is)
    candidates/index.json             (merged index over all parts, readable by StreamingDataset)
    candidates/manifest.json          (config, tokenizer fingerprint, per-source counts, finished parts)
    candidates/<source>/part-00000/   (one resumable part: ``sequences_per_part`` sequences, shuffled within)
    validation/...                    (same, for the target/validation sources)

Resume: the manifest is saved after each finished part together with the reader position of the first
document not wholly in finished parts and how many of its tokens are, so a rerun after a kill removes the
unfinished part, re-reads that document, drops its tokens already written, and produces the same sequences
as an uninterrupted run (no duplicates, none lost). The state holds no tokens: the manifest stays small and
memory stays bounded whatever the document sizes (huge documents are tokenized and packed in pieces).
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from curation.ingest.corpus import BadRecordError, Document, iter_documents, resolve_paths
from curation.ingest.demo import DEMO_FILES, write_demo_corpus
from curation.ingest.packing import Packer
from curation.ingest.token_sources import TokenRecord, iter_token_records, resolve_token_inputs
from curation.ingest.tokenizer import PIECE_CHARS, LoadedTokenizer, load_tokenizer, train_bpe_tokenizer
from curation.io import storage
from curation.io.outputs import localize, open_output, urls_in
from curation.io.shards import (
    merge_part_indexes,
    remove_incomplete_parts,
    save_manifest,
    verify_part,
    write_part,
)
from schemas.config import PrepareConfig, SourceConfig
from schemas.manifest import BadRecord, Manifest, ShardRecord
from schemas.outdir import config_diff
from schemas.shards import CANDIDATE, token_dtype
from schemas.stop import check_stop

__all__ = ["PrepareResult", "prepare", "GROUPS"]

#: (subdirectory, config attribute) of the two shard groups.
GROUPS = (("candidates", "sources"), ("validation", "validation"))
_ENCODE_BATCH = 256
_BATCH_CHARS = 1 << 20


@dataclass
class PrepareResult:
    tokenizer: LoadedTokenizer
    dirs: dict[str, str] = field(default_factory=dict)  # group → directory
    manifests: dict[str, Manifest] = field(default_factory=dict)
    tokens_processed: int = 0  # tokens tokenized in this run (resumed work is not counted)
    seconds: float = 0.0
    regenerated: list[str] = field(default_factory=list)  # damaged or missing parts rewritten by this run

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_processed / max(self.seconds, 1e-9)


def prepare(cfg: PrepareConfig) -> PrepareResult:
    """Run (or resume) the preparation described by ``cfg``, holding ``output_dir``'s lock.

    Raises:
        BadRecordError: bad input (names file and line) unless ``cfg.skip_bad_records``.
        OutputDirError: the output directory is in use, or was prepared with a different config
            (``output_dir/config.yaml``), or is not writable.
        ValueError: no sequence was produced.
    """
    cfg = localize(cfg)  # an s3:// output_dir: its local cache (curation.io.storage), filled from the bucket
    with open_output(cfg.output_dir, "prepare", {"config.yaml": cfg}) as lock:
        lock.write_records()
        return _prepare_locked(cfg)


def _demo_raw_dirs(cfg: PrepareConfig) -> list[str]:
    """Where to generate the demo corpus: the folders of configured paths named like a demo file, except
    folders that also hold other configured inputs (the user's data: overriding the sources of the
    embedded default must not write demo files next to them)."""
    paths = [p for s in [*cfg.sources, *cfg.validation] for p in s.paths]
    demo = {os.path.dirname(p) for p in paths if os.path.basename(p) in DEMO_FILES}
    other = {os.path.dirname(p) for p in paths if os.path.basename(p) not in DEMO_FILES}
    return sorted(demo - other)


def _prepare_locked(cfg: PrepareConfig) -> PrepareResult:
    start = time.perf_counter()
    for raw in _demo_raw_dirs(cfg) if cfg.demo else []:
        write_demo_corpus(raw)
    tok = _get_tokenizer(cfg)
    result = PrepareResult(tokenizer=tok)
    for group, attr in GROUPS:
        sources: list[SourceConfig] = getattr(cfg, attr)
        if not sources:
            continue
        out = os.path.join(cfg.output_dir, group)
        manifest, tokens = _prepare_group(cfg, group, out, sources, tok, result.regenerated)
        result.dirs[group] = out
        result.manifests[group] = manifest
        result.tokens_processed += tokens
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------------
def _files(source: SourceConfig, skip_bad: bool) -> tuple[list[str], list[BadRecordError]]:
    """The source's files (a pre-tokenized source's inputs: files, or MDS dataset directories), and (with
    ``skip_bad``) one bad record per pattern that matches nothing."""
    resolve = resolve_token_inputs if source.pre_tokenized else resolve_paths
    if not skip_bad:
        return resolve(source), []
    files: list[str] = []
    missing: list[BadRecordError] = []
    for pattern in source.paths:  # a missing path is one bad record, the others still count
        try:
            files.extend(resolve(source.model_copy(update={"paths": [pattern]})))
        except BadRecordError as e:
            missing.append(e)
    return sorted(set(files)), missing


def _documents(
    source: SourceConfig, skip_bad: bool, vocab_size: int | None = None, **pos
) -> Iterator[Document | TokenRecord | BadRecordError]:
    """Documents (a pre-tokenized source's token records: their ids checked against ``vocab_size``) of a source
    from a position; bad records raise unless ``skip_bad`` (then they are yielded to count). Patterns matching
    nothing are not yielded here (see :func:`_files`)."""
    files, _ = _files(source, skip_bad)
    at_start = pos.get("start_file", 0) == 0 and pos.get("start_record", 0) == 0
    to_skip = source.skip_documents if at_start else 0  # a resume position is already past them
    if source.pre_tokenized:
        assert vocab_size is not None, "token records are checked against the tokenizer's vocabulary"
        items = iter_token_records(source, files=files, vocab_size=vocab_size, **pos)
    else:
        items = iter_documents(source, files=files, **pos)
    for item in items:
        if to_skip:
            to_skip -= not isinstance(item, BadRecordError)
            continue
        if isinstance(item, BadRecordError) and not skip_bad:
            raise item
        yield item


def _batches(items: Iterator[Document | TokenRecord | BadRecordError],
             ) -> Iterator[list[Document | TokenRecord | BadRecordError]]:
    """Items in encode batches of at most ``_ENCODE_BATCH`` records and about ``_BATCH_CHARS`` characters (or
    bytes of token ids: a huge document or record ends its batch, so at most one is held at a time)."""
    batch: list[Document | TokenRecord | BadRecordError] = []
    chars = 0
    for item in items:
        batch.append(item)
        if isinstance(item, Document):
            chars += len(item.text)
        elif isinstance(item, TokenRecord):
            chars += item.ids.nbytes
        if len(batch) >= _ENCODE_BATCH or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _get_tokenizer(cfg: PrepareConfig) -> LoadedTokenizer:
    tc = cfg.tokenizer
    if tc.path is not None:
        return load_tokenizer(tc.path, eos_token=tc.eos_token)
    saved = os.path.join(cfg.output_dir, "tokenizer", "tokenizer.json")
    if os.path.exists(saved):  # resume: a trained tokenizer is saved atomically, so it is whole
        return load_tokenizer(saved, eos_token=tc.eos_token)

    def texts() -> Iterator[str]:
        for s in [*cfg.sources, *cfg.validation]:
            for item in _documents(s, cfg.skip_bad_records):
                if isinstance(item, Document):
                    yield item.text

    tok = train_bpe_tokenizer(
        itertools.islice(texts(), tc.train_max_documents),
        vocab_size=tc.vocab_size, min_frequency=tc.min_frequency, eos_token=tc.eos_token, save_to=saved,
    )
    storage.publish(saved)
    return tok


def _group_key(cfg: PrepareConfig, sources: list[SourceConfig], tok: LoadedTokenizer) -> dict:
    """Everything that determines a group's content: a rerun must match it to resume."""
    return {
        "sources": [s.model_dump(mode="json") for s in sources],
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "sequences_per_part": cfg.sequences_per_part,
        "skip_bad_records": cfg.skip_bad_records,
        "tokenizer_fingerprint": tok.fingerprint,
    }


def _prepare_group(
    cfg: PrepareConfig, group: str, out: str, sources: list[SourceConfig], tok: LoadedTokenizer,
    regenerated: list[str],
) -> tuple[Manifest, int]:
    key = _group_key(cfg, sources, tok)
    manifest = Manifest.load_if_exists(out)
    if manifest is not None and manifest.extra.get("group_key") != key:
        diff = [d.split(":", 1)[0] for d in config_diff(manifest.extra.get("group_key") or {}, key)]
        raise ValueError(
            f"{out}: was prepared with a different config (differs in: {', '.join(diff)}); "
            "use a new output_dir or delete this one"
        )
    if manifest is None:
        manifest = Manifest(
            kind=CANDIDATE.name, job="prepare", config=urls_in(cfg.model_dump(mode="json")),
            tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size, seq_len=cfg.seq_len,
            extra={"group": group, "group_key": key, "tokenizer_path": storage.canonical(tok.path)},
        )
    damaged = _repair_parts(cfg, out, sources, tok, manifest)
    regenerated.extend(os.path.join(out, name) for name in damaged)
    if manifest.complete:
        if damaged:
            merge_part_indexes(out, [s.name for s in manifest.shards if s.samples > 0])
        return manifest, 0
    os.makedirs(out, exist_ok=True)
    tokens = 0
    for si, source in enumerate(sources):
        remove_incomplete_parts(out, source.name, manifest.completed())
        tokens += _prepare_source(cfg, out, si, source, tok, manifest)
    parts = [s.name for s in manifest.shards if s.samples > 0]
    if not parts:
        raise ValueError(
            f"{out}: no sequence of {cfg.seq_len} tokens was produced; the {group} sources are too small "
            "for seq_len (see the manifest's dropped_tokens)"
        )
    merge_part_indexes(out, parts)
    manifest.complete = True
    save_manifest(out, manifest)
    return manifest, tokens


def _resume_state(out: str, last: ShardRecord | None) -> dict:
    """Where a source's reading resumes: the document that the last finished part ended in (``file``,
    ``record``) and how many of its tokens (with its EOS) are in finished parts (``skip``)."""
    if last is None:
        return {"file": 0, "record": 0, "skip": 0}
    st = last.state
    if "carry" in st:  # written by a version that kept the pending tokens in the manifest
        if st["carry"]:
            raise ValueError(
                f"{out}: this unfinished preparation was started by an older version that kept pending tokens "
                "in the manifest; delete the directory and rerun"
            )
        return {"file": st["file"], "record": st["record"], "skip": 0}
    return st


class _PartRewritten(Exception):
    """Stops :func:`_prepare_source` once the part it was asked to rewrite is on disk."""


def _repair_parts(
    cfg: PrepareConfig, out: str, sources: list[SourceConfig], tok: LoadedTokenizer, manifest: Manifest
) -> list[str]:
    """Check every finished part against the hashes in its index; rewrite damaged or missing ones.

    A part is a deterministic function of the input and of the previous part's resume state, so it is
    regenerated exactly: reading restarts at the state recorded before it and stops once it is written.
    The rewritten shard files must hash to what the root ``index.json`` recorded for them, else the input
    changed since (an error: the directory no longer matches its sources).
    """
    damaged = []
    for si, source in enumerate(sources):
        records = [r for r in manifest.shards if r.source == source.name]
        for k, rec in enumerate(records):
            problem = verify_part(os.path.join(out, rec.name)) if rec.samples > 0 else None
            if problem is None:
                continue
            warnings.warn(f"{out}/{rec.name} is damaged ({problem}); regenerating it", stacklevel=2)
            scratch = manifest.model_copy(update={"shards": records[:k], "sources": {}, "bad_records": []}, deep=True)
            try:
                _prepare_source(cfg, out, si, source, tok, scratch, rewrite=rec)
            except _PartRewritten:
                pass
            _check_rewritten(out, rec.name)
            damaged.append(rec.name)
    return damaged


def _check_rewritten(out: str, part: str) -> None:
    """The rewritten part's shard hashes equal those the root index recorded for it (when it has them)."""
    import json

    root = os.path.join(out, "index.json")
    if not os.path.exists(root):
        return  # an unfinished run: the root index is written at the end
    with open(root, encoding="utf-8") as f:
        before = [s for s in json.load(f)["shards"] if s["zip_data"]["basename"].startswith(part + "/")]
    with open(os.path.join(out, part, "index.json"), encoding="utf-8") as f:
        after = json.load(f)["shards"]
    if [s["zip_data"].get("hashes") for s in before] != [s["zip_data"].get("hashes") for s in after]:
        raise ValueError(
            f"{out}/{part}: regenerated, but its content differs from what was written before: the input files "
            "changed since this directory was prepared; prepare into a new output_dir"
        )


def _prepare_source(
    cfg: PrepareConfig, out: str, si: int, source: SourceConfig, tok: LoadedTokenizer, manifest: Manifest,
    rewrite: ShardRecord | None = None,
) -> int:
    """Tokenize, pack and write one source as parts of ``sequences_per_part`` sequences (resumable).

    Memory is bounded by one part plus the document being read: a document longer than ``PIECE_CHARS``
    is tokenized and packed piece by piece, and the resume state is a reader position and a token count
    (never tokens), so the manifest does not grow with documents either. Parts are written as soon as
    ``sequences_per_part`` sequences are full, i.e. while a document is being fed, so a part always ends
    inside the document being read (or at its EOS): a rerun re-reads that document and drops the tokens
    of it already in finished parts (``skip``).

    With ``rewrite`` (a finished part's record, ``manifest`` holding the records before it), only that part
    is written again, then :class:`_PartRewritten` is raised; the manifest is not saved.
    """
    records = [s for s in manifest.shards if s.source == source.name]
    last = records[-1] if records else None
    if last is not None and last.state.get("done"):
        return 0
    state = _resume_state(out, last)
    part = last.part + 1 if last is not None else 0
    counts = manifest.counts(source.name)
    dtype = np.dtype(token_dtype(tok.vocab_size))
    packer = Packer(seq_len=cfg.seq_len, eos_id=tok.eos_id)
    n = cfg.sequences_per_part
    pending: list[np.ndarray] = []
    to_skip = state["skip"]  # tokens of the first document already in finished parts
    fed = 0  # tokens of the current document so far (with the skipped ones)
    doc_pos = (state["file"], state["record"])  # reader position of the current document
    tokens = 0
    if last is None:
        for e in _files(source, cfg.skip_bad_records)[1]:
            manifest.add_bad_record(BadRecord(source=source.name, file=e.file, line=e.line, reason=e.reason))

    def flush(seqs: list[np.ndarray], state: dict) -> None:
        nonlocal part
        name = f"{source.name}/part-{part:05d}"
        if seqs:
            order = np.random.default_rng([cfg.seed, si, part]).permutation(len(seqs))
            write_part(
                os.path.join(out, name), CANDIDATE,
                ({"tokens": seqs[i].astype(dtype), "source": source.name} for i in order),
                vocab_size=tok.vocab_size, size_limit=cfg.shard_size_limit,
            )
        counts.sequences += len(seqs)
        if state.get("done"):
            counts.dropped_tokens = len(packer.carry)
        record = ShardRecord(
            name=name, source=source.name, part=part, samples=len(seqs), tokens=len(seqs) * cfg.seq_len, state=state,
        )
        if rewrite is not None:
            if record != rewrite:
                raise ValueError(f"{out}/{name}: regenerated as {record}, but the manifest recorded {rewrite}: the "
                                 "input files changed since this directory was prepared; prepare into a new output_dir")
            raise _PartRewritten()
        manifest.shards.append(record)
        save_manifest(out, manifest)  # the part is on disk (and in the bucket) before the manifest says so
        part += 1
        check_stop(f"after finishing {out}/{name}")  # SIGTERM/SIGINT: stop here, between parts (schemas.stop)

    def feed(ids: np.ndarray) -> None:
        nonlocal pending, fed, to_skip
        fed += len(ids)
        if to_skip:  # the start of the resumed document is in finished parts already
            k = min(to_skip, len(ids))
            ids, to_skip = ids[k:], to_skip - k
        pending.extend(packer.extend(ids))
        while len(pending) >= n:
            seqs, pending = pending[:n], pending[n:]
            # The part's last sequence ends in `ids` (fewer than n were pending before): all that is not
            # written yet belongs to the current document, so a rerun resumes inside it.
            written = fed - len(packer.carry) - len(pending) * cfg.seq_len
            assert fed - len(ids) < written <= fed
            flush(seqs, {"file": doc_pos[0], "record": doc_pos[1], "skip": written})

    eos = np.asarray([tok.eos_id], dtype=np.int64)
    items = _documents(source, cfg.skip_bad_records, tok.vocab_size, start_file=state["file"],
                       start_record=state["record"])
    bar = tqdm(desc=f"{os.path.basename(out)}/{source.name}", unit="doc", disable=not cfg.progress,
               initial=counts.documents, dynamic_ncols=True)
    stop = False
    with bar:
        for batch in _batches(items):
            short = [d.text for d in batch if isinstance(d, Document) and len(d.text) <= PIECE_CHARS]
            encoded = iter(tok.encode_batch(short))
            for item in batch:  # in input order, so counts match the saved position exactly
                if isinstance(item, BadRecordError):
                    manifest.add_bad_record(BadRecord(source=source.name, file=item.file, line=item.line,
                                                      reason=item.reason))
                    continue
                doc_pos, fed = (item.file_index, item.next_record - 1), 0
                if isinstance(item, TokenRecord):  # ids as they are; a stream's pieces hold their own EOS
                    pieces, ends = [item.ids], source.token_rows == "documents"
                else:
                    pieces = ([np.asarray(next(encoded), dtype=np.int64)] if len(item.text) <= PIECE_CHARS
                              else tok.encode_pieces(item.text, piece_chars=PIECE_CHARS))
                    ends = True
                for ids in pieces:
                    feed(ids)
                if ends:
                    feed(eos)
                # Counted once complete: a part written in the middle saves the counts without it, and a
                # rerun reads it again.
                counts.documents += 1
                counts.tokens += fed
                tokens += fed
                bar.update(1)
                if source.max_documents is not None and counts.documents >= source.max_documents:
                    stop = True
                    break
            if stop:
                break
    flush(pending, {"done": True})
    return tokens
