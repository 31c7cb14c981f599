"""curation.io.hf_export: the tokenizer a run's shards were made with, found from the config or the manifests, and
written beside the final weights so that ``AutoTokenizer`` loads it (issue 57)."""

from __future__ import annotations

import os
import shutil

from curation.io.hf_export import DEFAULT_EOS, TokenizerFiles, run_tokenizer, save_tokenizer
from curation.io.shards import shard_dir_info


def test_the_shards_tokenizer_is_the_configured_one_else_the_one_their_manifest_names_unchanged(engine_demo, tmp_path):
    cand = shard_dir_info(os.path.join(engine_demo, "data", "candidates"), "candidate")
    trained = os.path.join(engine_demo, "data", "tokenizer", "tokenizer.json")  # prepare trained it there
    assert run_tokenizer([cand], "given/tokenizer.json") == TokenizerFiles("given/tokenizer.json", DEFAULT_EOS)
    assert run_tokenizer([cand], None) == TokenizerFiles(trained, DEFAULT_EOS)
    moved = tmp_path / "candidates"
    shutil.copytree(cand.path, moved)
    info = shard_dir_info(str(moved), "candidate")
    info.manifest.extra["tokenizer_path"] = str(tmp_path / "gone.json")  # not there any more
    assert run_tokenizer([info], None) is None
    other = tmp_path / "other.json"
    other.write_text(open(trained).read().replace('"<|endoftext|>"', '"<|eos|>"'))  # another file: another sha256
    info.manifest.extra["tokenizer_path"] = str(other)
    assert run_tokenizer([info], None) is None


def test_a_saved_tokenizer_loads_with_auto_tokenizer_and_encodes_as_the_original(engine_demo, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    trained = os.path.join(engine_demo, "data", "tokenizer", "tokenizer.json")
    written = save_tokenizer(TokenizerFiles(trained), str(tmp_path / "final"))
    assert sorted(os.path.basename(p) for p in written) == ["special_tokens_map.json", "tokenizer.json",
                                                            "tokenizer_config.json"]
    assert sorted(os.listdir(tmp_path / "final")) == sorted(os.path.basename(p) for p in written)  # no temporary left
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    text = "Tom has 3 apples and buys 4 more."
    assert tok(text).input_ids == Tokenizer.from_file(trained).encode(text).ids
    assert tok.eos_token == tok.bos_token == DEFAULT_EOS
    again = save_tokenizer(TokenizerFiles(str(tmp_path / "final")), str(tmp_path / "copy"))  # an HF directory
    assert AutoTokenizer.from_pretrained(os.path.dirname(again[0]))(text).input_ids == tok(text).input_ids
