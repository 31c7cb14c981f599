"""Scoring a model's whole-document token loss on an evaluation set: what :class:`bench.quality.runs.Evaluator`
does in its own process and what its prefetch's worker processes run. A module of its own that imports torch, the
model and the tokenizer but not Composer (nor, through it, torchmetrics and scipy): a spawned worker imports the
module of the function it is sent, and ``bench.quality.runs`` (training: Composer) cost a scoring worker ≈ 8 s of
CPU before its first model, this one ≈ 2.
"""

from __future__ import annotations

import torch

from curation.evaluation.heldout import read_set, score_documents
from curation.ingest.tokenizer import load_tokenizer
from curation.io.models import build_causal_lm
from schemas.config import SourceConfig
from schemas.train_config import ModelConfig

__all__ = ["score", "score_in_worker"]


def score(mcfg: ModelConfig, weights: str, tok, texts: list[str], max_len: int, device: str) -> dict[str, list]:
    """The scores (:meth:`DocScores.to_json`) of the model ``mcfg`` with ``weights`` on ``texts``."""
    model = build_causal_lm(mcfg.model_copy(update={"weights": weights})).to(device).eval()
    return score_documents(model, tok, texts, max_len=max_len, batch_size=32).to_json()


def score_in_worker(mcfg: ModelConfig, weights: str, tokenizer: str, sources: dict[str, SourceConfig],
                    max_len: int, threads: int, device: str) -> dict[str, dict[str, list]]:
    """:func:`score` on each of ``sources`` (by the caller's key), with ``threads`` torch threads: a pool job."""
    torch.set_num_threads(threads)
    tok = load_tokenizer(tokenizer)
    return {skey: score(mcfg, weights, tok, read_set(src), max_len, device) for skey, src in sources.items()}
