"""token_losses, target_valid, model_logits and batch normalisation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from curation.core.losses import TokenBatch, as_token_batch, model_logits, target_valid, token_losses


def _hand_nll(row: list[float], target: int) -> float:
    return -(row[target] - math.log(sum(math.exp(x) for x in row)))


def test_token_losses_matches_hand_computed_cross_entropy():
    # b=1, L=3, V=3: position n is predicted from logits[:, n-1].
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [5.0, -1.0, 0.5]]])
    tokens = torch.tensor([[2, 0, 1]])
    losses, valid = token_losses(logits, tokens)
    assert losses.dtype == torch.float32 and losses.shape == (1, 3)
    assert valid.tolist() == [[False, True, True]]
    # position 1: target 0 under [1, 2, 3] -> 2 + log(1 + e^-1 + e^-2) = 2.40760596...
    assert losses[0, 1].item() == pytest.approx(2.4076059644, abs=1e-6)
    assert losses[0, 1].item() == pytest.approx(_hand_nll([1.0, 2.0, 3.0], 0), abs=1e-6)
    # position 2: target 1 under uniform logits -> log 3
    assert losses[0, 2].item() == pytest.approx(math.log(3.0), abs=1e-6)
    assert losses[0, 0].item() == 0.0  # position 0 predicts nothing


def test_padding_positions_are_invalid_zero_and_not_read():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    logits[1, 2] = float("nan")  # logits at a padded context position predict a padded target only
    tokens = torch.tensor([[1, 2, 3, 4], [0, 1, -100, -100]])  # out-of-range ids at padding
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    losses, tv = token_losses(logits, tokens, valid)
    assert tv.tolist() == [[False, True, True, True], [False, True, False, False]]
    assert losses[1, 2:].tolist() == [0.0, 0.0]
    assert torch.isfinite(losses).all()
    expected = torch.nn.functional.cross_entropy(logits[0, :3], tokens[0, 1:], reduction="none")
    torch.testing.assert_close(losses[0, 1:], expected)


def test_bf16_logits_give_float32_losses_equal_to_upcast_computation():
    torch.manual_seed(1)
    logits = (torch.randn(2, 6, 11) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (2, 6))
    losses, _ = token_losses(logits, tokens)
    assert losses.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, 11), tokens[:, 1:].reshape(-1), reduction="none"
    ).view(2, 5)
    torch.testing.assert_close(losses[:, 1:], ref, rtol=0, atol=1e-6)


def test_chunking_does_not_change_values_or_gradients():
    torch.manual_seed(2)
    logits = torch.randn(3, 7, 13, requires_grad=True)
    tokens = torch.randint(0, 13, (3, 7))
    full, _ = token_losses(logits, tokens)
    (g_full,) = torch.autograd.grad(full.sum(), logits)
    # blocks of 2 sequences, blocks of 4 positions within a sequence, and 1 logit row at a time
    for chunk in (6 * 13 * 2, 13 * 4, 1):
        chunked, _ = token_losses(logits, tokens, chunk_elements=chunk)
        torch.testing.assert_close(full, chunked, rtol=0, atol=0)
        (g_chunk,) = torch.autograd.grad(chunked.sum(), logits)
        torch.testing.assert_close(g_full, g_chunk)
    assert g_full[:, -1].abs().sum() == 0  # the last logits predict nothing


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="shape"):
        token_losses(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        token_losses(torch.randn(2, 4, 5), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="bool"):
        target_valid(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))


def test_target_valid_does_not_modify_input():
    valid = torch.ones(1, 3, dtype=torch.bool)
    out = target_valid(torch.zeros(1, 3, dtype=torch.long), valid)
    assert out.tolist() == [[False, True, True]] and valid.all()


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 7)

    def forward(self, x):
        return self.emb(x)


class _HFLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 7)
        self.seen_mask = None

    def forward(self, input_ids=None, attention_mask=None):
        self.seen_mask = attention_mask
        return type("Out", (), {"logits": self.emb(input_ids)})()


def test_model_logits_plain_and_hf_like_modules():
    tokens = torch.tensor([[1, 2, 3]])
    plain = _Plain()
    torch.testing.assert_close(model_logits(plain, tokens), plain.emb(tokens))
    hf = _HFLike()
    torch.testing.assert_close(model_logits(hf, tokens, torch.ones(1, 3, dtype=torch.bool)), hf.emb(tokens))
    assert hf.seen_mask is None  # all valid: no mask passed
    model_logits(hf, tokens, torch.tensor([[True, True, False]]))
    assert hf.seen_mask.tolist() == [[1, 1, 0]]


def test_as_token_batch_forms():
    t = torch.zeros(1, 2, dtype=torch.long)
    v = torch.ones(1, 2, dtype=torch.bool)
    assert as_token_batch(t).tokens is t
    b = as_token_batch((t, v, v))
    assert b.valid is v and b.mask is v
    m = as_token_batch({"input_ids": t, "attention_mask": torch.ones(1, 2, dtype=torch.long), "loss_mask": v})
    assert m.valid.dtype == torch.bool and m.mask is v
    assert as_token_batch(TokenBatch(t)).valid is None
    with pytest.raises(TypeError):
        as_token_batch(3)


@pytest.mark.parametrize("shape,chunk", [((3, 7, 13), 1 << 25), ((4, 9, 50), 2 * 9 * 50), ((2, 5, 31), 31 * 2),
                                         ((1, 2, 7), 1), ((5, 16, 257), 1 << 25)])
def test_values_and_gradients_equal_the_sliced_cross_entropy_bit_for_bit(shape, chunk):
    """Whole-row blocks (no copy of `logits[:, :-1]`) give exactly the plain per-position computation."""
    torch.manual_seed(sum(shape))
    b, length, vocab = shape
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(shape) * 3).to(dtype).requires_grad_(True)
        tokens = torch.randint(0, vocab, (b, length))
        weights = torch.rand(b, length)
        got, _ = token_losses(logits, tokens, chunk_elements=chunk)
        plain = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none"
        ).view(b, length - 1)
        want = torch.cat([torch.zeros(b, 1), plain], dim=1)
        assert torch.equal(got, want)
        (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
        (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
        assert torch.equal(g_got, g_want)  # (-0.0 == 0.0: the dropped last position may give signed zeros)


# --- per-token losses from the final hidden states (no full logits) --------------------------------------
def _tiny_llama(vocab: int = 64, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                        tie_word_embeddings=tie)).eval()


@pytest.mark.parametrize("chunk", [None, 64 * 7, 64 * 300])  # default (one GEMM), 256-row GEMMs + overlap
def test_hidden_token_losses_equal_the_plain_cross_entropy(chunk):
    import torch.nn.functional as F

    from curation.core.losses import hidden_token_losses

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 200, 16, generator=gen)  # 600 rows: 256 + 256 + the last 256 (88 of them new)
    head, bias = torch.randn(64, 16, generator=gen), torch.randn(64, generator=gen)
    tokens = torch.randint(0, 64, (3, 200), generator=gen)
    valid = torch.ones(3, 200, dtype=torch.bool)
    valid[1, 135:] = False
    tokens[1, 135:] = -100  # padding ids are never read
    got, gv = hidden_token_losses(hidden, head, tokens, valid, bias=bias, chunk_elements=chunk)
    logits = F.linear(hidden, head, bias)
    want = torch.zeros(3, 200)
    for i in range(3):
        for n in range(1, 200):
            if valid[i, n]:
                want[i, n] = F.cross_entropy(logits[i, n - 1 : n].double(), tokens[i, n : n + 1]).float()
    assert torch.equal(gv, target_valid(tokens, valid))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    same, _ = token_losses(logits, tokens, valid)
    assert torch.equal(got, same)  # CPU float32: bit for bit the full-logits computation


def test_hidden_token_losses_never_hold_more_than_one_chunk_of_logits(monkeypatch):
    import torch.nn.functional as F

    from curation.core.losses import hidden_token_losses

    shapes = []
    linear = F.linear

    def spy(x, w, b=None):
        out = linear(x, w, b)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(F, "linear", spy)
    hidden, head = torch.randn(4, 150, 8), torch.randn(100, 8)
    hidden_token_losses(hidden, head, torch.randint(0, 100, (4, 150)), chunk_elements=100 * 300)
    assert shapes == [(256, 100)] * 3  # 600 rows: 256 rows of logits at a time (the last overlapping)


def test_bf16_hidden_states_within_stated_tolerance_of_float32():
    """bf16 hidden states and head (the workers' bf16 path): float32 losses within 1% (relative, |ℓ| ≥ 1)
    of the float32 computation; and equal to the full bf16 logits' losses."""
    import torch.nn.functional as F

    from curation.core.losses import hidden_token_losses

    gen = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(2, 48, 64, generator=gen), torch.randn(512, 64, generator=gen) * 0.1
    tokens = torch.randint(0, 512, (2, 48), generator=gen)
    ref, _ = hidden_token_losses(hidden, head, tokens)
    got, _ = hidden_token_losses(hidden.bfloat16(), head.bfloat16(), tokens)
    assert got.dtype == torch.float32
    rel = (got - ref).abs() / ref.abs().clamp(min=1.0)
    assert float(rel.max()) < 1e-2
    full, _ = token_losses(F.linear(hidden.bfloat16(), head.bfloat16()), tokens)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_model_token_losses_skip_the_logits_of_hf_models_with_the_same_values(tie, monkeypatch):
    from curation.core.losses import model_token_losses

    model = _tiny_llama(tie=tie)
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    valid = torch.ones(3, 16, dtype=torch.bool)
    valid[2, :4] = False  # left padding: an attention mask is passed
    with torch.no_grad():
        want = token_losses(model_logits(model, tokens, valid), tokens, valid)
        calls = []
        monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1))  # the LM head is skipped
        got = model_token_losses(model, tokens, valid)
    assert not calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_model_token_losses_fall_back_to_logits_for_other_models():
    from curation.core.losses import model_token_losses

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 10)

        def forward(self, tokens):
            return self.emb(tokens)

    plain = Plain()
    tokens = torch.randint(0, 10, (2, 5))
    with torch.no_grad():
        assert torch.equal(model_token_losses(plain, tokens)[0], token_losses(plain(tokens), tokens)[0])
    capped = _tiny_llama()
    capped.config.final_logit_softcapping = 30.0  # logits are not lm_head(hidden) any more: no shortcut
    from curation.core.losses import _plain_head

    assert _plain_head(capped) is None and _plain_head(_tiny_llama()) is not None


@pytest.mark.gpu
def test_bf16_autocast_scoring_on_cuda_within_tolerance_of_float32():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (bf16 autocast scoring path)")
    from curation.core.losses import autocast, model_token_losses

    model = _tiny_llama(vocab=512).cuda()
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(3)).cuda()
    device = torch.device("cuda")
    with torch.inference_mode():
        with autocast("fp32", device):
            ref, _ = model_token_losses(model, tokens)
        with autocast("amp_bf16", device):
            got, _ = model_token_losses(model, tokens)
            full = token_losses(model_logits(model, tokens), tokens)[0]
    assert got.dtype == torch.float32
    assert float(((got - ref).abs() / ref.abs().clamp(min=1.0)).max()) < 3e-2
    torch.testing.assert_close(got, full, rtol=1e-3, atol=1e-3)


def test_autocast_setting():
    from curation.core.losses import autocast

    cpu = torch.device("cpu")
    x = torch.randn(4, 4)
    for precision in ("fp32", "amp_bf16"):  # on a CPU every precision computes in float32
        with autocast(precision, cpu):
            assert (x @ x).dtype == torch.float32
    with pytest.raises(ValueError, match="precision must be 'fp32' or 'amp_bf16', got 'bf16'"):
        autocast("bf16", cpu)


def test_one_pass_nll_equals_the_cross_entropy_and_the_cpu_keeps_the_cross_entropy_bits():
    """_nll_rows (compiled for scoring on CUDA) is the cross-entropy as log-sum-exp minus the target's logit; on a
    CPU, and wherever gradients are on, the losses stay F.cross_entropy's bits (the oracle tests compare bits)."""
    import torch.nn.functional as F

    from curation.core.losses import _cross_entropy_rows, _nll_rows

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 1000, generator=g) * 4
    targets = torch.randint(0, 1000, (37,), generator=g)
    ce = F.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(_nll_rows(logits, targets), ce, rtol=0, atol=2e-5)
    by_hand = torch.log(torch.exp(logits.double()).sum(-1)) - logits.double()[torch.arange(37), targets]
    torch.testing.assert_close(_nll_rows(logits, targets).double(), by_hand, rtol=0, atol=2e-5)
    low = logits.bfloat16()  # bf16 logits: upcast inside, float32 result
    assert _nll_rows(low, targets).dtype == torch.float32
    torch.testing.assert_close(_nll_rows(low, targets), F.cross_entropy(low.float(), targets, reduction="none"),
                               rtol=0, atol=2e-5)
    with torch.inference_mode():
        assert torch.equal(_cross_entropy_rows(logits, targets), ce)  # a CPU: never the compiled path


@pytest.mark.gpu
def test_scoring_on_cuda_runs_the_compiled_one_pass_loss_within_float32_rounding_of_the_cross_entropy():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the compiled per-token loss)")
    import torch.nn.functional as F

    from curation.core import losses

    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(300, 32000, generator=g) * 4).cuda().bfloat16()
    tokens = torch.randint(0, 32000, (3, 100), generator=g).cuda()
    with torch.inference_mode():
        got, _ = token_losses(logits.view(3, 100, 32000), tokens)
    assert losses._FUSED["fn"] not in (None, False), losses._FUSED["error"]  # compiled and used
    flat_t = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1).reshape(-1)
    eager = F.cross_entropy(logits.float(), flat_t, reduction="none").view(3, 100)
    torch.testing.assert_close(got[:, 1:], eager[:, :-1], rtol=0, atol=1e-4)
    assert float(got[:, 0].abs().max()) == 0
    with torch.inference_mode():  # more rows than a chunk holds: one compiled pass over all of them, the same values
        whole, _ = token_losses(logits.view(3, 100, 32000), tokens, chunk_elements=32000 * 50)
    assert torch.equal(whole, got)
