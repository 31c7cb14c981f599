import numpy as np
import pytest

from curation.ingest.packing import Packer, pack_documents


def test_pack_conserves_tokens_and_places_eos():
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    seqs, rest = pack_documents(docs, seq_len=4, eos_id=0)
    stream = [t for d in docs for t in (*d, 0)]
    assert seqs.shape == (len(stream) // 4, 4)
    assert seqs.reshape(-1).tolist() + rest == stream  # nothing lost, nothing reordered
    assert rest == stream[len(stream) // 4 * 4 :]
    assert seqs[0].tolist() == [1, 2, 3, 0] and seqs[1].tolist() == [4, 0, 5, 6]


def test_exact_length_documents_leave_no_remainder():
    seqs, rest = pack_documents([[7, 7, 7], [8, 8, 8]], seq_len=4, eos_id=9)
    assert seqs.tolist() == [[7, 7, 7, 9], [8, 8, 8, 9]] and rest == []


def test_resume_from_carry_equals_uninterrupted():
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 50, rng.integers(1, 30)).tolist() for _ in range(40)]
    full, rest = pack_documents(docs, seq_len=8, eos_id=0)
    a = Packer(seq_len=8, eos_id=0)
    out = [s for d in docs[:17] for s in a.add(d)]
    b = Packer(seq_len=8, eos_id=0, carry=a.carry)
    out += b.drain() + [s for d in docs[17:] for s in b.add(d)]
    assert np.array_equal(np.stack(out), full) and b.carry == rest


def test_carry_longer_than_a_sequence_drains():
    p = Packer(seq_len=3, eos_id=0, carry=list(range(1, 8)))
    assert [s.tolist() for s in p.drain()] == [[1, 2, 3], [4, 5, 6]] and p.carry == [7]


def test_seq_len_validated():
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        Packer(seq_len=1, eos_id=0)
