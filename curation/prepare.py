"""Corpus preparation: named sources → tokenized, packed, zstd MDS candidate (and validation) shards.

Layout of ``output_dir``::

    tokenizer/tokenizer.json          (trained here, or a copy of nothing: a given tokenizer stays where it is)
    candidates/index.json             (merged index over all parts, readable by StreamingDataset)
    candidates/manifest.json          (config, tokenizer fingerprint, per-source counts, finished parts)
    candidates/<source>/part-00000/   (one resumable part: ``sequences_per_part`` sequences, shuffled within)
    validation/...                    (same, for the target/validation sources)

Resume: the manifest is saved after each finished part together with the reader position and the packer's
carry, so a rerun after a kill removes the unfinished part, restarts reading exactly where the last finished
part stopped, and produces the same sequences as an uninterrupted run (no duplicates, none lost).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from curation.corpus import BadRecordError, Document, iter_documents, resolve_paths
from curation.demo import DEMO_FILES, write_demo_corpus
from curation.packing import Packer
from curation.shards import merge_part_indexes, remove_incomplete_parts, write_part
from curation.tokenizer import LoadedTokenizer, load_tokenizer, train_bpe_tokenizer
from schemas.config import PrepareConfig, SourceConfig
from schemas.manifest import BadRecord, Manifest, ShardRecord
from schemas.outdir import config_diff, open_output_dir
from schemas.shards import CANDIDATE, token_dtype

__all__ = ["PrepareResult", "prepare", "GROUPS"]

#: (subdirectory, config attribute) of the two shard groups.
GROUPS = (("candidates", "sources"), ("validation", "validation"))
_ENCODE_BATCH = 256


@dataclass
class PrepareResult:
    tokenizer: LoadedTokenizer
    dirs: dict[str, str] = field(default_factory=dict)  # group → directory
    manifests: dict[str, Manifest] = field(default_factory=dict)
    tokens_processed: int = 0  # tokens tokenized in this run (resumed work is not counted)
    seconds: float = 0.0

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
    with open_output_dir(cfg.output_dir, "prepare", {"config.yaml": cfg}) as lock:
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
        manifest, tokens = _prepare_group(cfg, group, out, sources, tok)
        result.dirs[group] = out
        result.manifests[group] = manifest
        result.tokens_processed += tokens
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------------
def _documents(source: SourceConfig, skip_bad: bool, **pos) -> Iterator[Document | BadRecordError]:
    """Documents of a source; bad records raise unless ``skip_bad`` (then they are yielded to count)."""
    if skip_bad:
        files: list[str] = []
        for pattern in source.paths:  # a missing path is one bad record, the others still count
            try:
                files.extend(resolve_paths(source.model_copy(update={"paths": [pattern]})))
            except BadRecordError as e:
                yield e
        files = sorted(set(files))
    else:
        files = resolve_paths(source)
    at_start = pos.get("start_file", 0) == 0 and pos.get("start_record", 0) == 0
    to_skip = source.skip_documents if at_start else 0  # a resume position is already past them
    for item in iter_documents(source, files=files, **pos):
        if to_skip:
            to_skip -= isinstance(item, Document)
            continue
        if isinstance(item, BadRecordError) and not skip_bad:
            raise item
        yield item


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

    return train_bpe_tokenizer(
        itertools.islice(texts(), tc.train_max_documents),
        vocab_size=tc.vocab_size, min_frequency=tc.min_frequency, eos_token=tc.eos_token, save_to=saved,
    )


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
    cfg: PrepareConfig, group: str, out: str, sources: list[SourceConfig], tok: LoadedTokenizer
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
            kind=CANDIDATE.name, job="prepare", config=cfg.model_dump(mode="json"),
            tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size, seq_len=cfg.seq_len,
            extra={"group": group, "group_key": key, "tokenizer_path": os.path.abspath(tok.path)},
        )
    if manifest.complete:
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
    manifest.save(out)
    return manifest, tokens


def _prepare_source(
    cfg: PrepareConfig, out: str, si: int, source: SourceConfig, tok: LoadedTokenizer, manifest: Manifest
) -> int:
    records = [s for s in manifest.shards if s.source == source.name]
    last = records[-1] if records else None
    if last is not None and last.state.get("done"):
        return 0
    state = last.state if last is not None else {"file": 0, "record": 0, "carry": []}
    part = last.part + 1 if last is not None else 0
    counts = manifest.counts(source.name)
    dtype = np.dtype(token_dtype(tok.vocab_size))
    packer = Packer(seq_len=cfg.seq_len, eos_id=tok.eos_id, carry=state["carry"])
    pending: list[np.ndarray] = packer.drain()
    pos = (state["file"], state["record"])
    tokens = 0

    def flush(seqs: list[np.ndarray], carry: list[int], done: bool) -> None:
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
        if done:
            counts.dropped_tokens = len(carry)
        state = {"file": pos[0], "record": pos[1], "carry": [] if done else carry, "done": done}
        manifest.shards.append(ShardRecord(
            name=name, source=source.name, part=part, samples=len(seqs), tokens=len(seqs) * cfg.seq_len, state=state,
        ))
        manifest.save(out)  # the part is on disk before the manifest says so
        part += 1

    n = cfg.sequences_per_part
    items = _documents(source, cfg.skip_bad_records, start_file=pos[0], start_record=pos[1])
    bar = tqdm(desc=f"{os.path.basename(out)}/{source.name}", unit="doc", disable=not cfg.progress,
               initial=counts.documents, dynamic_ncols=True)
    stop = False
    with bar:
        while not stop:
            batch = list(itertools.islice(items, _ENCODE_BATCH))
            if not batch:
                break
            docs = [d for d in batch if isinstance(d, Document)]
            encoded = iter(tok.encode_batch([d.text for d in docs]))
            for item in batch:  # in input order, so counts match the saved position exactly
                if isinstance(item, BadRecordError):
                    manifest.add_bad_record(BadRecord(source=source.name, file=item.file, line=item.line,
                                                      reason=item.reason))
                    continue
                ids = next(encoded)
                counts.documents += 1
                counts.tokens += len(ids) + 1
                tokens += len(ids) + 1
                pending.extend(packer.add(ids))
                pos = (item.file_index, item.next_record)
                while len(pending) >= n:
                    rest = pending[n:]
                    carry = [int(t) for s in rest for t in s] + packer.carry
                    flush(pending[:n], carry, done=False)
                    pending = rest
                if source.max_documents is not None and counts.documents >= source.max_documents:
                    stop = True
                    break
            bar.update(len(docs))
    flush(pending, packer.carry, done=True)
    return tokens
