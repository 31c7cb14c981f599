"""refresh_reference and train_static_reference on tiny Llamas built from a config."""

from __future__ import annotations

import copy
import itertools
import os
import sys

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from curation.core.losses import TokenBatch, model_logits, token_losses
from curation.core.refresh import (
    RefreshSettings,
    RefreshStart,
    joint_forward_on,
    refresh_reference,
    train_static_reference,
)
from curation.core.selection import masked_mean
from curation.core.stats import param_distance
from tests.conftest import REPO, cuda_syncs

VOCAB = 32
SEQ = 24


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def candidate_batch(gen: torch.Generator, b: int = 4) -> TokenBatch:
    """Candidate domain: uniform noise over the low half of the vocabulary, random selection α."""
    tokens = torch.randint(0, VOCAB // 2, (b, SEQ), generator=gen)
    mask = torch.rand(b, SEQ, generator=gen) < 0.6
    return TokenBatch(tokens, None, mask)


def val_batch(gen: torch.Generator, b: int = 4) -> TokenBatch:
    """Validation domain: counting sequences (+1 mod 16) in the high half: easy to learn, disjoint."""
    start = torch.randint(0, VOCAB // 2, (b, 1), generator=gen)
    return TokenBatch(VOCAB // 2 + (start + torch.arange(SEQ)) % (VOCAB // 2))


def val_stream(seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield val_batch(gen)


def cand_stream(seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield candidate_batch(gen)


@torch.no_grad()
def mean_loss(model: nn.Module, batch: TokenBatch) -> float:
    losses, valid = token_losses(model_logits(model, batch.tokens, batch.valid), batch.tokens, batch.valid)
    return float(masked_mean(losses, valid))


def trained_proxy(steps: int = 4) -> tuple[LlamaForCausalLM, torch.optim.AdamW]:
    """A tiny Llama trained a few steps on candidate data, with its own AdamW state."""
    proxy = tiny_llama(0)
    opt = torch.optim.AdamW(proxy.parameters(), lr=3e-3, weight_decay=0.01)
    cands = cand_stream(100)
    for _ in range(steps):
        b = next(cands)
        opt.zero_grad()
        losses, valid = token_losses(proxy(input_ids=b.tokens).logits, b.tokens)
        masked_mean(losses, valid).backward()
        opt.step()
    return proxy, opt


SETTINGS = {"lam": 1.0, "lr": 1e-2, "weight_decay": 0.01, "grad_clip": 1.0}


def settings(steps: int, **changes) -> RefreshSettings:
    """``K = steps`` with the tests' ``SETTINGS``, ``changes`` applied."""
    return RefreshSettings(refresh_steps=steps, **{**SETTINGS, **changes})


def test_k_zero_returns_the_proxy_weights_exactly_without_aliasing():
    proxy, _ = trained_proxy(2)
    result = refresh_reference(proxy, [], [], settings(0))
    assert result.steps == 0 and result.val_losses == []
    ref_sd, proxy_sd = result.state_dict(), proxy.state_dict()
    assert ref_sd.keys() == proxy_sd.keys()
    for k in proxy_sd:
        assert torch.equal(ref_sd[k], proxy_sd[k]), k
        assert ref_sd[k].data_ptr() != proxy_sd[k].data_ptr(), k
    assert param_distance(result.model, proxy) == 0.0
    assert not result.model.training


def test_proxy_parameters_optimizer_and_mode_unchanged_by_refresh():
    proxy, opt = trained_proxy(3)
    proxy.train()
    # gradients present on the proxy, as mid-step
    b = next(cand_stream(5))
    losses, valid = token_losses(proxy(input_ids=b.tokens).logits, b.tokens)
    masked_mean(losses, valid).backward()
    params_before = copy.deepcopy(proxy.state_dict())
    grads_before = {n: p.grad.clone() for n, p in proxy.named_parameters()}
    opt_before = copy.deepcopy(opt.state_dict())

    result = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(3))

    assert result.steps == 3 and param_distance(result.model, proxy) > 0
    for k, v in proxy.state_dict().items():
        assert torch.equal(v, params_before[k]), k
    for n, p in proxy.named_parameters():
        assert torch.equal(p.grad, grads_before[n]), n
    opt_after = opt.state_dict()
    assert opt_after["param_groups"] == opt_before["param_groups"]
    for i, st in opt_before["state"].items():
        for key, val in st.items():
            assert torch.equal(opt_after["state"][i][key], val), (i, key)
    assert proxy.training
    # the reference owns its tensors: changing it cannot reach the proxy
    with torch.no_grad():
        for p in result.model.parameters():
            p.add_(1.0)
    for k, v in proxy.state_dict().items():
        assert torch.equal(v, params_before[k]), k


def test_refreshed_reference_has_lower_validation_loss_than_the_proxy():
    proxy, _ = trained_proxy(4)
    held_out = val_batch(torch.Generator().manual_seed(999), b=8)
    proxy_val = mean_loss(proxy, held_out)
    result = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(25))
    ref_val = mean_loss(result.model, held_out)
    assert ref_val < proxy_val - 0.5, (proxy_val, ref_val)
    assert result.val_losses[-1] < result.val_losses[0]
    assert len(result.train_losses) == len(result.objectives) == 25
    for o, v, t in zip(result.objectives, result.val_losses, result.train_losses, strict=True):
        assert o == pytest.approx(v + SETTINGS["lam"] * t, rel=1e-5)


def test_lambda_weighs_the_candidate_term():
    proxy, _ = trained_proxy(2)
    with_cand = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(3))
    no_cand = refresh_reference(proxy, val_stream(1), None, settings(3, lam=0.0))
    assert no_cand.train_losses == [] and no_cand.objectives == no_cand.val_losses
    assert param_distance(with_cand.model, no_cand.model) > 0


def test_candidate_mask_restricts_the_candidate_loss():
    """Only α-selected candidate tokens contribute: changing unselected tokens changes nothing."""
    proxy, _ = trained_proxy(1)
    gen = torch.Generator().manual_seed(3)
    cand = candidate_batch(gen)
    mask = torch.zeros_like(cand.mask)
    mask[:, 1:5] = True
    tokens_b = cand.tokens.clone()
    tokens_b[:, 8:] = (tokens_b[:, 8:] + 1) % VOCAB  # positions >= 8 are unselected and never context
    vals = [val_batch(torch.Generator().manual_seed(4))]
    a = refresh_reference(proxy, vals, [TokenBatch(cand.tokens, None, mask)], settings(1))
    b = refresh_reference(proxy, vals, [TokenBatch(tokens_b, None, mask)], settings(1))
    assert a.train_losses == b.train_losses
    assert param_distance(a.model, b.model) == 0.0
    c = refresh_reference(proxy, vals, [TokenBatch(cand.tokens, None, ~mask)], settings(1))
    assert c.train_losses != a.train_losses


def test_nosync_starts_from_previous_reference():
    proxy, _ = trained_proxy(2)
    previous = refresh_reference(proxy, val_stream(7), cand_stream(8), settings(4)).model
    # K = 0 from `previous` returns previous's weights, not the proxy's
    same = refresh_reference(proxy, [], [], settings(0), RefreshStart(previous=previous))
    assert param_distance(same.model, previous) == 0.0 and param_distance(same.model, proxy) > 0
    # state dicts work as well as modules
    same_sd = refresh_reference(proxy, [], [], settings(0), RefreshStart(previous=previous.state_dict()))
    assert param_distance(same_sd.model, previous) == 0.0
    # K > 0: identical to refreshing `previous` itself as if it were the proxy, different from sync
    cont = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(3), RefreshStart(previous=previous))
    manual = refresh_reference(previous, val_stream(1), cand_stream(2), settings(3))
    sync = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(3))
    assert param_distance(cont.model, manual.model) == 0.0
    assert param_distance(cont.model, sync.model) > 0
    assert param_distance(cont.model, previous) > 0  # previous itself is untouched by continuing
    assert param_distance(same.model, previous) == 0.0


def test_optimizer_state_carry_equals_one_long_run():
    proxy, _ = trained_proxy(2)
    vals, cands = list(itertools.islice(val_stream(1), 4)), list(itertools.islice(cand_stream(2), 4))
    long = refresh_reference(proxy, vals, cands, settings(4))
    first = refresh_reference(proxy, vals[:2], cands[:2], settings(2))
    second = refresh_reference(proxy, vals[2:], cands[2:], settings(2), RefreshStart(previous=first.model, optimizer_state=first.optimizer_state))
    assert param_distance(second.model, long.model) == 0.0
    fresh = refresh_reference(proxy, vals[2:], cands[2:], settings(2), RefreshStart(previous=first.model))
    assert param_distance(fresh.model, long.model) > 0


def test_gradient_clipping_applies():
    proxy, _ = trained_proxy(1)
    tight = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(1, grad_clip=1e-6))
    loose = refresh_reference(proxy, val_stream(1), cand_stream(2), settings(1, grad_clip=None))
    assert tight.grad_norms == pytest.approx(loose.grad_norms)  # reported norm is before clipping
    assert tight.grad_norms[0] > 1e-3
    # Adam normalises the step size, so compare the second moment instead: clipped grads are tiny
    sq_tight = sum(float(s["exp_avg_sq"].sum()) for s in tight.optimizer_state["state"].values())
    sq_loose = sum(float(s["exp_avg_sq"].sum()) for s in loose.optimizer_state["state"].values())
    assert sq_tight < 1e-9 * sq_loose


def test_running_out_of_batches_and_bad_settings_raise():
    proxy = tiny_llama(0)
    with pytest.raises(ValueError, match="val_batches ran out after 1 of 2"):
        refresh_reference(proxy, [val_batch(torch.Generator())], cand_stream(0), settings(2))
    with pytest.raises(ValueError, match="cand_batches ran out after 0 of 1"):
        refresh_reference(proxy, val_stream(0), [], settings(1))
    with pytest.raises(ValueError, match="cand_batches is required"):
        refresh_reference(proxy, val_stream(0), None, settings(1))
    with pytest.raises(ValueError, match=r"^refresh_steps must be an int >= 0, got -1$"):
        settings(-1)
    with pytest.raises(ValueError, match=r"^rho1_steps must be an int >= 0, got True$"):
        RefreshSettings(rho1_steps=True)
    with pytest.raises(ValueError, match=r"^lr \(η_w\) must be > 0, got 0.0$"):
        settings(0, lr=0.0)
    with pytest.raises(ValueError, match=r"^lam \(λ\) must be >= 0, got -0.5$"):
        settings(0, lam=-0.5)
    with pytest.raises(ValueError, match=r"^grad_clip must be >= 0 or None, got -1.0$"):
        settings(0, grad_clip=-1.0)


def test_static_reference_trains_a_copy_of_the_base_on_validation_data():
    base = tiny_llama(3)
    before = copy.deepcopy(base.state_dict())
    held_out = val_batch(torch.Generator().manual_seed(999), b=8)
    result = train_static_reference(base, val_stream(1), RefreshSettings(rho1_steps=20, lr=1e-2))
    assert mean_loss(result.model, held_out) < mean_loss(base, held_out) - 0.5
    assert result.train_losses == []
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k


class _PlainLM(nn.Module):
    """A non-HF causal LM: forward(tokens) -> logits (bigram model)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


def test_plain_modules_returning_logits_are_accepted():
    torch.manual_seed(0)
    model = _PlainLM()
    held_out = val_batch(torch.Generator().manual_seed(999))
    result = refresh_reference(model, val_stream(1), cand_stream(2), settings(10, lam=0.5, lr=0.1))
    assert mean_loss(result.model, held_out) < mean_loss(model, held_out)


def test_padded_batches_and_tuple_batches():
    proxy = tiny_llama(0)
    gen = torch.Generator().manual_seed(0)
    v = val_batch(gen)
    valid = torch.ones_like(v.tokens, dtype=torch.bool)
    valid[:, -5:] = False
    tokens = v.tokens.clone()
    tokens[:, -5:] = 0
    c = candidate_batch(gen)
    result = refresh_reference(proxy, [(tokens, valid)], [(c.tokens, None, c.mask)], settings(1))
    assert result.steps == 1 and all(torch.isfinite(torch.tensor(result.objectives)))


def _refreshed_both_ways(proxy, episode, steps, fresh, kept, ws):
    """Move the proxy as training between refreshes would, then refresh it from fresh copies (``fresh``: previous
    reference and AdamW state) and through the workspace ``ws`` (``kept``): the two agree bit for bit, buffers
    (e.g. rotary frequencies) included. Returns both results."""
    with torch.no_grad():
        for p in proxy.parameters():
            p.add_(0.01 * (episode + 1))
    a = refresh_reference(proxy, val_stream(episode), cand_stream(10 + episode), settings(steps), RefreshStart(previous=fresh[0], optimizer_state=fresh[1]))
    b = refresh_reference(proxy, val_stream(episode), cand_stream(10 + episode), settings(steps), RefreshStart(previous=kept[0], optimizer_state=kept[1], workspace=ws))
    assert a.objectives == b.objectives and a.grad_norms == b.grad_norms
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for x, y in zip(a.model.buffers(), b.model.buffers(), strict=True))
    return a, b


@pytest.mark.parametrize("continue_mode", [False, True], ids=["blade", "blade-nosync"])
def test_workspace_reuses_one_module_and_optimizer_with_the_same_values(continue_mode):
    """Three refreshes with a workspace equal three with fresh copies bit for bit; one module, one AdamW."""
    from curation.core.refresh import CONTINUE, RefreshWorkspace

    proxy = tiny_llama(0)
    ws = RefreshWorkspace(keep_optimizer_state=continue_mode)
    fresh_prev, fresh_state, ws_prev, ws_state = None, None, None, None
    modules, optimizers = set(), set()
    for episode in range(3):
        a, b = _refreshed_both_ways(proxy, episode, 3, (fresh_prev, fresh_state), (ws_prev, ws_state), ws)
        modules.add(id(b.model))
        optimizers.add(id(ws.optimizer))
        # blade releases the AdamW moments between refreshes; blade-nosync keeps them (and continues them)
        assert (len(ws.optimizer.state) > 0) == continue_mode
        if continue_mode:
            fresh_prev, fresh_state = a.model, copy.deepcopy(a.optimizer_state)
            ws_prev, ws_state = b.model, CONTINUE  # continued in place, no copy
    assert len(modules) == 1 and len(optimizers) == 1
    assert all(p.requires_grad for p in proxy.parameters())  # the proxy is not frozen by the reuse


@pytest.mark.parametrize("continue_mode", [False, True], ids=["blade", "blade-nosync"])
def test_a_parked_workspace_comes_back_without_a_rebuild_and_with_the_same_values(continue_mode):
    """Offloading between refreshes (a GPU run) parks the workspace: blade's weights give up their storage, every
    AdamW moment is released (nosync's come back as a state dict from the host). The next refresh allocates them
    again in the same module and optimizer objects and gives the values of fresh copies bit for bit."""
    from curation.core.refresh import RefreshWorkspace

    proxy = tiny_llama(0)
    ws = RefreshWorkspace(keep_optimizer_state=continue_mode)
    fresh_prev = fresh_state = ws_prev = host = None
    module = optimizer = params = None
    for episode in range(3):
        carried = host if continue_mode and episode else None
        a, b = _refreshed_both_ways(proxy, episode, 2, (fresh_prev, fresh_state), (ws_prev, carried), ws)
        if module is None:
            module, optimizer, params = b.model, ws.optimizer, list(b.model.parameters())
        assert b.model is module and ws.optimizer is optimizer  # nothing rebuilt
        assert all(x is y for x, y in zip(params, module.parameters(), strict=True))
        host = copy.deepcopy(b.optimizer_state) if continue_mode else None  # what the host store keeps
        ws.park(weights=not continue_mode)
        assert not ws.optimizer.state
        if continue_mode:
            fresh_prev, fresh_state, ws_prev = a.model, copy.deepcopy(a.optimizer_state), b.model
        else:
            assert all(t.numel() == 0 for t in [*module.parameters(), *module.buffers()])  # storage released


def test_a_state_carried_into_a_new_workspace_is_continued_exactly_without_a_copy():
    """blade-nosync after an offload: the state comes back from the host into a new workspace, whose AdamW
    takes it over (its tensors, not copies) and continues as one long run would; the next refresh continues the
    workspace's AdamW in place (``CONTINUE``)."""
    from curation.core.refresh import CONTINUE, RefreshWorkspace

    proxy, _ = trained_proxy(2)
    vals, cands = list(itertools.islice(val_stream(1), 4)), list(itertools.islice(cand_stream(2), 4))
    long = refresh_reference(proxy, vals, cands, settings(4))
    first = refresh_reference(proxy, vals[:2], cands[:2], settings(2))
    carried = copy.deepcopy(first.optimizer_state)
    ws = RefreshWorkspace(keep_optimizer_state=True)
    second = refresh_reference(proxy, vals[2:], cands[2:], settings(2), RefreshStart(previous=first.model.state_dict(), optimizer_state=carried, workspace=ws))
    assert param_distance(second.model, long.model) == 0.0
    assert int(second.optimizer_state["state"][0]["step"]) == 4
    p0 = next(iter(second.model.parameters()))
    moment = ws.optimizer.state[p0]["exp_avg"]
    assert moment is carried["state"][0]["exp_avg"]  # taken over, updated in place
    third = refresh_reference(proxy, vals[:1], cands[:1], settings(1), RefreshStart(previous=second.model, optimizer_state=CONTINUE, workspace=ws))
    assert ws.optimizer.state[p0]["exp_avg"] is moment and int(third.optimizer_state["state"][0]["step"]) == 5
    with pytest.raises(ValueError, match="continues a workspace's AdamW: pass the workspace"):
        refresh_reference(proxy, vals, cands, settings(1), RefreshStart(optimizer_state=CONTINUE))
    with pytest.raises(ValueError, match="optimizer_state must be a state dict, 'continue' or None"):
        refresh_reference(proxy, vals, cands, settings(1), RefreshStart(optimizer_state="resume", workspace=ws))


@pytest.mark.gpu
def test_bf16_refresh_on_cuda_tracks_the_float32_refresh():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (refresh under bf16 autocast)")
    proxy = tiny_llama(0).cuda()
    a = refresh_reference(proxy, val_stream(0), cand_stream(1), settings(5))
    b = refresh_reference(proxy, val_stream(0), cand_stream(1), settings(5, precision="amp_bf16"))
    assert b.objectives != a.objectives  # bf16 really ran
    assert max(abs(x - y) / max(abs(x), 1.0) for x, y in zip(a.objectives, b.objectives, strict=True)) < 3e-2


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of a tensor's value into Python (``float``, ``bool``, ``int``, ``.item()``, ``.tolist()``)
    made outside torch itself, by the file that made them: on a GPU each is a host–device synchronisation. (AdamW's
    own reads of its step counts are left out: those tensors live on the host.)"""

    READS = {"__float__", "__bool__", "__int__", "__index__", "item", "tolist"}

    def __init__(self):
        super().__init__()
        self.by_file: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            caller = sys._getframe(1).f_code.co_filename
            if f"{os.sep}torch{os.sep}" not in caller:
                self.by_file[caller] = self.by_file.get(caller, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lam", [0.0, 1.0])
def test_a_refresh_reads_its_figures_from_the_device_once_not_per_step(lam):
    """The host never waits for a refresh step: the K steps' losses and norms are read at the end, in one read, and
    the divergence check reads every weight's finiteness at once, so a GPU can queue step k+1 while step k runs."""
    proxy = tiny_llama(0)
    reads = {}
    for k in (2, 6):
        with _HostReads() as mode:
            res = refresh_reference(proxy, val_stream(0), cand_stream(1), settings(k, lam=lam))
        reads[k] = mode.by_file
        assert len(res.val_losses) == len(res.objectives) == len(res.grad_norms) == k
        assert len(res.train_losses) == (k if lam else 0)
    assert reads[2] == reads[6]  # not one more per step
    ours = {os.path.relpath(f, REPO): n for f, n in reads[6].items()}
    assert ours == {"curation/core/refresh.py": 1, "curation/core/divergence.py": 1}
    # the figures are the steps' own: recomputed one step at a time from the same start
    one = refresh_reference(proxy, val_stream(0), cand_stream(1), settings(1, lam=lam))
    assert one.val_losses[0] == res.val_losses[0] and one.grad_norms[0] == res.grad_norms[0]
    assert one.objectives[0] == pytest.approx(mean_loss(proxy, next(val_stream(0))) + lam * (
        one.train_losses[0] if lam else 0.0))


@pytest.mark.gpu
def test_a_refresh_on_cuda_synchronises_as_often_for_any_k():
    """The device-side count of the test above: CUDA's own sync detector sees no more synchronisations for K = 6
    than for K = 2 (the steps never wait for the host, nor the host for them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.set_sync_debug_mode)")
    proxy = tiny_llama(0).cuda()
    refresh_reference(proxy, val_stream(0), cand_stream(1), settings(1))  # warm-up: lazy inits, kernel loads
    syncs = {}
    for k in (2, 6):
        with cuda_syncs() as where:
            refresh_reference(proxy, val_stream(0), cand_stream(1), settings(k))
        syncs[k] = {x: where.count(x) for x in where}
    assert syncs[2] == syncs[6], syncs  # where each synchronisation was made, for K = 2 and K = 6


def _padded_cand_stream(seed: int, *, float_mask: bool = False):
    """Candidate batches whose last row is padded at its end, with a boolean or a float selection."""
    for b in cand_stream(seed):
        valid = torch.ones_like(b.tokens, dtype=torch.bool)
        valid[-1, SEQ // 2:] = False
        yield TokenBatch(b.tokens, valid, b.mask.float() * 0.5 if float_mask else b.mask)


@pytest.mark.parametrize("cands", ["plain", "padded", "float-mask"])
def test_one_forward_over_validation_and_candidate_rows_trains_the_same_reference(cands):
    """joint_forward (the default on a GPU, driven here on the CPU): the stacked rows' losses are the separate
    forwards' own, so the K steps' figures and the trained weights agree to float32 rounding; by default a CPU
    keeps the separate forwards bit for bit."""
    stream = {"plain": lambda: cand_stream(1), "padded": lambda: _padded_cand_stream(1),
              "float-mask": lambda: _padded_cand_stream(1, float_mask=True)}[cands]
    proxy = tiny_llama(0)
    runs = {mode: refresh_reference(proxy, val_stream(0), stream(), settings(3, lam=0.5, joint_forward=mode))
            for mode in (None, False, True)}
    default, apart, joint = runs[None], runs[False], runs[True]
    assert default.val_losses == apart.val_losses and default.train_losses == apart.train_losses
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), apart.state_dict().values(), strict=True))
    for name in ("val_losses", "train_losses", "objectives", "grad_norms"):
        assert getattr(joint, name) == pytest.approx(getattr(apart, name), rel=1e-5, abs=1e-6), name
    assert joint.val_losses[0] == pytest.approx(mean_loss(proxy, next(val_stream(0))), rel=1e-6)  # step 1 at w_0
    moved = [(a - b).abs().max().item() for a, b in zip(joint.state_dict().values(), apart.state_dict().values(),
                                                        strict=True)]
    assert max(moved) < 1e-5  # the same steps: at most float32 rounding apart


def test_rows_of_another_length_or_a_misshapen_mask_fall_back_to_separate_forwards():
    """Stacking needs one length: a candidate batch of another length is scored on its own, and a mask of the wrong
    shape gets the separate path's error naming both shapes."""
    proxy = tiny_llama(0)
    longer = (TokenBatch(torch.cat([b.tokens, b.tokens[:, :4]], 1), None, torch.cat([b.mask, b.mask[:, :4]], 1))
              for b in cand_stream(1))
    joint = refresh_reference(proxy, val_stream(0), longer, settings(2, lam=0.5, joint_forward=True))
    longer = (TokenBatch(torch.cat([b.tokens, b.tokens[:, :4]], 1), None, torch.cat([b.mask, b.mask[:, :4]], 1))
              for b in cand_stream(1))
    apart = refresh_reference(proxy, val_stream(0), longer, settings(2, lam=0.5, joint_forward=False))
    assert joint.val_losses == apart.val_losses and joint.train_losses == apart.train_losses  # the same path
    bad = (TokenBatch(b.tokens, None, b.mask[:, :-1]) for b in cand_stream(1))
    with pytest.raises(ValueError, match=r"candidate mask has shape \(4, 23\), tokens have \(4, 24\)"):
        refresh_reference(proxy, val_stream(0), bad, settings(1, joint_forward=True))


def test_the_joint_forward_is_a_selection_setting_of_the_run():
    """`selection.refresh_joint_forward` reaches the settings every refresh of a run is built from (the trainer's
    reference, the engine's refresh actor, the oracle loop); strict: a non-boolean is refused naming the setting."""
    from pydantic import ValidationError

    from schemas.train_config import SelectionConfig

    for value in (None, True, False):
        sel = SelectionConfig(refresh_joint_forward=value)
        assert RefreshSettings.of(sel, lr=1e-3, batch_size=2, precision="fp32").joint_forward is value
    assert SelectionConfig().refresh_joint_forward is None  # on a GPU only
    assert [joint_forward_on(None, torch.device(d)) for d in ("cpu", "cuda")] == [False, True]
    assert [joint_forward_on(v, torch.device("cpu")) for v in (True, False)] == [True, False]
    with pytest.raises(ValidationError, match="refresh_joint_forward"):
        SelectionConfig(refresh_joint_forward="sometimes")
