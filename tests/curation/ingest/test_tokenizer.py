import numpy as np
import pytest

from curation.ingest.tokenizer import load_tokenizer, train_bpe_tokenizer
from schemas.manifest import sha256_file

TEXTS = [f"The quick brown fox {i} jumps over {i * 7} lazy dogs. 12 + {i} = {12 + i}." for i in range(300)]


def test_training_is_deterministic(tmp_path):
    a = train_bpe_tokenizer(iter(TEXTS), vocab_size=400, save_to=str(tmp_path / "a" / "tokenizer.json"))
    b = train_bpe_tokenizer(iter(TEXTS), vocab_size=400, save_to=str(tmp_path / "b" / "tokenizer.json"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a.fingerprint == b.fingerprint == sha256_file(a.path)
    assert a.eos_id == 0 and a.vocab_size == 400
    ids = a.encode_batch(["héllo wörld ✓"])[0]
    assert a.tokenizer.decode(ids) == "héllo wörld ✓"  # byte-level: no unknown tokens
    assert max(ids) < a.vocab_size


def test_load_directory_and_eos_check(tmp_path):
    t = train_bpe_tokenizer(iter(TEXTS), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    again = load_tokenizer(str(tmp_path / "tok"))
    assert again.fingerprint == t.fingerprint
    with pytest.raises(ValueError, match=r"EOS token '</s>' is not in the vocabulary"):
        load_tokenizer(str(tmp_path / "tok"), eos_token="</s>")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_gpt2_tokenizer(gpt2_tokenizer):
    tok = load_tokenizer(gpt2_tokenizer)
    assert tok.eos_id == 50256 and tok.vocab_size == 50257
    assert tok.encode_batch(["Hello world"])[0] == [15496, 995]


def test_encode_pieces_equals_whole_encoding(tmp_path, shared_data, gpt2_tokenizer):
    """Huge documents are tokenized in pieces cut at a space between letters: same ids as a whole encoding
    (Shakespeare and web text, with blank lines, punctuation, digits, runs of spaces and non-ASCII)."""
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:60_000]
    text += "  double  spaces, 1234 5678 ünïcödé wörds ✓\n\n\t tabs " + text[:5000]
    bpe = train_bpe_tokenizer(iter([text[:20_000]]), vocab_size=500, save_to=str(tmp_path / "t" / "tokenizer.json"))
    for tok in (bpe, load_tokenizer(gpt2_tokenizer)):
        whole = tok.encode_batch([text])[0]
        for piece_chars, at_once in ((7, 1), (100, 1), (4096, 1), (100, 3), (4096, 8)):
            pieces = list(tok.encode_pieces(text, piece_chars=piece_chars, at_once=at_once))
            assert len(pieces) > len(text) // (piece_chars + 200)  # really cut into pieces
            assert np.concatenate(pieces).tolist() == whole, (piece_chars, at_once)
    no_space = "x" * 5000  # no safe cut: encoded whole, still exact
    assert [len(p) for p in bpe.encode_pieces(no_space, piece_chars=100)] == [len(bpe.encode_batch([no_space])[0])]
