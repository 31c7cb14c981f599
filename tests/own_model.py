"""A user's own corpus and model, made in the test: text as jsonl, parquet and txt, and a local Hugging Face GPT-2
directory (``save_pretrained``: config.json, model.safetensors) holding its own tokenizer (tokenizer.json and
tokenizer_config.json, a byte-level BPE trained on that text). Nothing is downloaded."""

from __future__ import annotations

import json
import os
import random

#: The EOS token of the tokenizer (the prepare default's).
EOS = "<|endoftext|>"
VOCAB = 384
#: The tiny GPT-2: 1 layer of width 32, positions for 128 tokens.
GPT2 = {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 128}

_WORDS = ("parse read write file buffer stream token model layer value index error return module class function "
          "package release fixed changed upload version debian urgency medium low security option command manual "
          "synopsis description flags print exit status see also author copyright").split()


def _text(rng: random.Random, kind: str) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(30, 90))]
    head = {"docs": "def f(x):\n    ", "changelog": "pkg (1.2-3) unstable; urgency=low\n  * ", "man": "NAME\n  "}[kind]
    return head + " ".join(words)


def write_own_corpus(root: str, *, docs: int = 240, seed: int = 0) -> dict[str, str]:
    """Three sources of made-up text under ``root``: ``docs.jsonl`` (field ``text``), ``changelogs.parquet``
    (column ``body``), ``man.txt`` (documents between blank lines), and a validation ``target.jsonl``. Returns name →
    path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    paths = {"docs": os.path.join(root, "docs.jsonl"), "changelogs": os.path.join(root, "changelogs.parquet"),
             "man": os.path.join(root, "man.txt"), "target": os.path.join(root, "target.jsonl")}
    with open(paths["docs"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": _text(rng, "docs")}) + "\n" for _ in range(docs))
    pq.write_table(pa.table({"body": [_text(rng, "changelog") for _ in range(docs)]}), paths["changelogs"])
    with open(paths["man"], "w", encoding="utf-8") as f:
        f.write("\n\n".join(_text(rng, "man").replace("\n", " ") for _ in range(docs)) + "\n")
    with open(paths["target"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": _text(rng, "docs")}) + "\n" for _ in range(docs // 4))
    return paths


def write_own_model(directory: str, corpus: dict[str, str]) -> str:
    """A GPT-2 directory as ``save_pretrained`` writes it, with a tokenizer trained on ``corpus``'s jsonl text (a
    ``PreTrainedTokenizerFast``: what ``AutoTokenizer`` loads back). Returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    with open(corpus["docs"], encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    tok.save_pretrained(directory)
    eos = tok.convert_tokens_to_ids(EOS)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos, **GPT2))
    model.save_pretrained(directory)
    return directory
