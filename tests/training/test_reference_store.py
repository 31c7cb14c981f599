"""Where the in-process reference lives between refreshes: the compact bfloat16 copy and its holder."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from curation.core.stats import param_distance
from curation.io.models import build_causal_lm
from curation.io.shards import read_column
from schemas.train_config import demo_model_config
from training.runs.train_job import train
from training.selection.host_buffers import (
    REGISTER_MIN_BYTES,
    CompactReference,
    HostOptimizerState,
    page_aligned,
)
from training.selection.reference import OptimizerAt, Where


class _Tied(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one storage, two state-dict names
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)


def _rounded(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).float() for k, v in module.state_dict().items()}


def test_compact_reference_round_trips_through_bfloat16_and_stores_tied_weights_once():
    a = _Tied(0)
    store = CompactReference(pin=False)
    assert not store.holds and store.nbytes == 0
    store.store(a, version=3)
    assert store.holds and store.version == 3
    unique = sum(p.numel() for p in a.parameters())  # parameters() yields the tied weight once: 40 + 20 + 0
    assert unique == 10 * 4 + 4 * 4 + 4
    assert store.nbytes == 2 * unique  # bfloat16, the tied weight once
    state = store.state_dict()
    assert set(state) == set(a.state_dict()) and all(v.dtype == torch.bfloat16 for v in state.values())
    assert all(torch.equal(state[k].float(), v) for k, v in _rounded(a).items())
    b = _Tied(1)
    b.load_state_dict(state, strict=True)  # cast back to float32 by load_state_dict
    assert all(torch.equal(b.state_dict()[k], v) for k, v in _rounded(a).items())
    assert b.head.weight is b.emb.weight
    # the distance statistic reads the parameters exactly as it would read the rounded module's
    assert set(store.parameters()) == {n for n, _ in a.named_parameters()}
    c = _Tied(2)
    assert param_distance(c, store.parameters()) == param_distance(c, b)


def test_compact_reference_reuses_its_buffer_and_copies_out():
    a, b = _Tied(0), _Tied(1)
    store = CompactReference(pin=False)
    store.store(a, version=0)
    kept = store.state_dict()
    ptr = store._buffer.data_ptr()
    store.store(b, version=1)
    assert store._buffer.data_ptr() == ptr  # the next refresh reuses the allocation
    assert all(torch.equal(kept[k].float(), v) for k, v in _rounded(a).items())  # copies, not views
    assert all(torch.equal(store.state_dict()[k].float(), v) for k, v in _rounded(b).items())
    store.clear()
    assert not store.holds and store.nbytes == 2 * 60  # forgotten, still allocated



def test_a_page_aligned_buffer_has_pages_of_its_own_and_outlives_its_owner_in_its_views():
    """What a pinned buffer of REGISTER_MIN_BYTES or more is registered on (cudaHostRegister pins whole pages: a heap
    block sharing a page with another registered buffer would fail to register)."""
    t = page_aligned(3 * mmap.PAGESIZE // 4 + 1, torch.float32)  # 3 pages and 4 bytes: 4 pages mapped
    assert t.dtype == torch.float32 and t.shape == (3 * mmap.PAGESIZE // 4 + 1,) and t.is_contiguous()
    assert t.data_ptr() % mmap.PAGESIZE == 0
    u = page_aligned(10, torch.bfloat16)
    a, b = t.data_ptr(), u.data_ptr()
    assert b >= a + 4 * mmap.PAGESIZE or a >= b + mmap.PAGESIZE  # no page shared with the other buffer
    t.fill_(2.0)
    view = t[5:9]
    del t
    assert torch.equal(view, torch.full((4,), 2.0))  # the mapping lives as long as a view of it
    assert page_aligned(0, torch.float32).numel() == 0


def test_the_final_save_reads_the_compact_reference_without_a_copy_and_writes_each_tensor_once(tmp_path):
    """What finish writes right after the fit: views into the buffer (no second reference on the host while
    the trained weights are copied out), which save_weights writes as tensors of their own (safetensors refuses
    tensors sharing storage); the file holds the rounded weights and a tied weight under both names."""
    from curation.io.models import read_weights, save_weights

    a = _Tied(0)
    store = CompactReference(pin=False)
    store.store(a, version=0)
    views = store.state_dict(copy=False)
    base = store._buffer.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views.values())  # no copy
    assert all(v.untyped_storage().data_ptr() != base for v in store.state_dict().values())  # copies
    path = save_weights(views, str(tmp_path / "reference.safetensors"))
    back = read_weights(path)
    assert set(back) == set(a.state_dict()) and all(torch.equal(back[k].float(), v) for k, v in _rounded(a).items())
    assert all(torch.equal(v.float(), _rounded(a)[k]) for k, v in views.items())  # the buffer is untouched


sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_parts import make_reference  # noqa: E402

CFG = demo_model_config(64, hidden=16, layers=1)


def _reference(policy: str):
    """A real reference of ``policy`` on small fixed rows (2 refresh steps on validation rows only)."""
    g = torch.Generator().manual_seed(3)
    val = torch.randint(0, 64, (8, 16), generator=g)
    recent = [{"tokens": torch.randint(0, 64, (2, 16), generator=g), "mask": torch.ones(2, 16, dtype=torch.bool)}]
    return make_reference(CFG, policy, val=val, recent=recent, score=torch.randint(0, 64, (2, 16), generator=g),
                          steps=2, lam=0.0)


def test_a_scored_reference_is_kept_compact_off_the_training_device_and_nothing_moves_on_a_cpu():
    module = build_causal_lm(CFG)
    expected = _rounded(module)
    ref, _ = _reference("blade")
    ref.use(module, 0)  # fresh from a refresh: stays where it was computed
    assert ref.where is Where.DEVICE
    ref.offload(compact=True)  # training on a CPU: nothing moves, the float32 module stays
    assert ref.module is module and not ref.compact.holds and ref.where is Where.DEVICE
    ref.train_device = torch.device("cuda")  # as the reference records it on a GPU (no CUDA call on this path)
    workspace = ref.workspace
    ref.offload(compact=True)
    assert ref.module is None and ref.where is Where.COMPACT and ref.workspace is workspace  # parked, kept
    assert isinstance(ref.for_distance(), dict)
    state = ref.weights()
    assert all(torch.equal(state[k].float(), v) for k, v in expected.items())
    with pytest.raises(RuntimeError, match="no reference module to score with .*compacted"):
        ref.losses(0)
    ref.drop()
    assert ref.for_distance() is None and ref.weights() is None and ref.where is Where.NONE
    ref.use(module, 1)  # the next refresh's module (on the host here: the recorded device is CUDA)
    assert ref.module is module and ref.where is Where.HOST and ref.scorer.version == 1


@pytest.mark.gpu
def test_blade_on_cuda_keeps_the_scored_reference_compact_with_the_same_masks(make_config):
    """On a GPU with offloading, blade's reference is compact between its scoring and the next refresh: the
    masks equal a run that keeps it in float32 on the device (offload_reference=false), the saved final
    reference is the bfloat16-rounded last reference, and ‖u − w̃‖ is logged at every selecting step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the offload path moves weights off the GPU)")
    # 11 steps: the last episode (τ = 3 from step 8) is whole, so its reference is compacted once scored (an
    # episode cut short by max_steps stays float32 for a run extended from the checkpoint; seen at 12 on an H200)
    common = dict(max_steps=11, device="cuda", eval={"interval": 100})
    cfg = make_config("blade", "compact", **common)
    with _deterministic():
        on = train(cfg)
    compact = on.run.algorithm.reference.compact
    assert compact.holds  # after the last episode's scoring
    # pinned; this tiny model's buffer (under REGISTER_MIN_BYTES) is a block of the caching host allocator
    assert compact._buffer.is_pinned() and compact.nbytes < REGISTER_MIN_BYTES and compact._registered is None
    big = CompactReference()  # a reference of 1.5 MB: its own pages, registered exactly, unpinned on release
    big.store(nn.Linear(768, 1024, bias=False).cuda(), version=0)
    ptr = big._buffer.data_ptr()
    assert big._registered == ptr and big._buffer.is_pinned() and ptr % mmap.PAGESIZE == 0
    assert big.nbytes == 768 * 1024 * 2
    big._release()
    assert big._registered is None and not big._buffer.is_pinned()
    parked = on.run.algorithm.reference.workspace  # the refresh module kept for the next refresh, without memory
    assert parked.model is not None and all(t.numel() == 0 for t in parked.model.parameters())
    off_cfg = make_config("blade", "on-device", selection={"offload_reference": False}, **common)
    with _deterministic():
        off = train(off_cfg)
    assert not off.run.algorithm.reference.compact.holds
    ma, mb = (read_column(o.selected, "loss_mask") for o in (on, off))
    assert all(np.array_equal(x, y) for x, y in zip(ma, mb, strict=True))
    ref = load_file(os.path.join(cfg.output_dir, "final", "reference.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in ref.values())
    dist = {}
    for name, c in (("compact", cfg), ("fp32", off_cfg)):
        with open(os.path.join(c.output_dir, "summary.json"), encoding="utf-8") as f:
            dist[name] = [p["value"] for p in json.load(f)["param_distance"]]
    assert len(dist["compact"]) == len(dist["fp32"]) == 11 - 2  # every selecting step (W = 2)
    # ‖u − w̃‖ against the bfloat16-rounded w̃: close to the float32 one, not equal
    assert np.allclose(dist["compact"], dist["fp32"], rtol=1e-2)


@contextlib.contextmanager
def _deterministic():
    """Deterministic CUDA kernels for runs compared mask for mask: the embedding's backward otherwise accumulates with
    atomics, so two identical runs may round a loss differently and flip a token at the top-γ boundary."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def _tensors(state: dict) -> list[torch.Tensor]:
    return [v for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]


def _same_state(a: dict, b: dict) -> bool:
    return a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)
        for x, y in zip(a["state"].values(), b["state"].values(), strict=True))


def _adamw_state(module: nn.Module, steps: int, seed: int) -> dict:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    return opt.state_dict()


def test_host_optimizer_state_keeps_adamw_exactly_in_one_reused_float32_buffer():
    module = _Tied(0)
    state = _adamw_state(module, steps=3, seed=0)
    store = HostOptimizerState(pin=False)
    assert not store.holds and store.nbytes == 0
    store.store(state)
    params = sum(p.numel() for p in module.parameters())  # 60
    # exp_avg and exp_avg_sq of every weight, and one float32 step count per parameter tensor (3)
    assert store.holds and store.nbytes == 4 * (2 * params + 3)
    host = store.state_dict()
    assert _same_state(host, state)
    ptr = store._buffer.data_ptr()
    assert all(t.untyped_storage().data_ptr() == ptr for t in _tensors(host))  # views of the one buffer
    buf = io.BytesIO()  # a checkpoint saves and loads it like the live state
    torch.save(host, buf)
    buf.seek(0)
    assert _same_state(torch.load(buf, weights_only=True), state)
    back = store.restore()  # new tensors, not views: the optimizer that loads them updates them in place
    assert _same_state(back, state) and all(t.untyped_storage().data_ptr() != ptr for t in _tensors(back))
    back["state"][0]["exp_avg"].add_(1.0)
    assert _same_state(store.state_dict(), state)
    later = _adamw_state(module, steps=5, seed=1)  # the next refresh: same sizes, same allocation
    store.store(later)
    assert store._buffer.data_ptr() == ptr and _same_state(store.state_dict(), later)
    store.clear()
    assert not store.holds and store.nbytes == 4 * (2 * params + 3)


def test_host_optimizer_state_keeps_tensors_of_other_dtypes_as_they_are():
    module = nn.Linear(3, 2).double()  # float64 moments, float32 step counts
    state = _adamw_state(module, steps=2, seed=0)
    store = HostOptimizerState(pin=False)
    store.store(state)
    assert store.nbytes == 4 * 2  # the two step counts; the moments are held as float64 copies
    assert _same_state(store.state_dict(), state) and _same_state(store.restore(), state)


def _refresh(ref, proxy: nn.Module, recent, version: int) -> dict:
    """One blade-nosync refresh as the algorithm runs it, the reference offloaded after its scoring; returns a copy
    of the carried AdamW state after that (as a checkpoint holds it)."""
    ref.refresh(proxy, version, recent)
    ref.offload()
    return copy.deepcopy(ref.optimizer_state())


def test_blade_nosync_moves_its_adamw_state_to_the_host_with_the_reference_and_continues_it_exactly():
    """The CPU test of the GPU path (recorded device): the carried AdamW state leaves with the reference into one
    reused host buffer and comes back for the next refresh, bit for bit the run that keeps it in place."""
    proxy = build_causal_lm(CFG)
    on_cpu, recent = _reference("blade-nosync")  # training on a CPU: nothing moves, the live state is continued
    kept = []
    for version in range(3):
        kept.append(_refresh(on_cpu, proxy, recent, version))
        assert on_cpu.optimizer_at is OptimizerAt.OPTIMIZER and not on_cpu.optimizer_host.holds
    assert on_cpu.optimizer_host.nbytes == 0 and kept[0]["state"][0]["step"] == 2 and kept[2]["state"][0]["step"] == 6

    off, _ = _reference("blade-nosync")
    off.train_device = torch.device("cuda")  # as the reference records it on a GPU (no CUDA call on this path)
    moved, ptrs = [], []
    for version in range(3):
        moved.append(_refresh(off, proxy, recent, version))
        assert off.optimizer_at is OptimizerAt.HOST and not off.workspace.optimizer.state  # the moments went too
        assert off.where is Where.HOST
        ptrs.append(off.optimizer_host._buffer.data_ptr())
    assert len(set(ptrs)) == 1  # one buffer, reused refresh after refresh
    assert all(_same_state(a, b) for a, b in zip(kept, moved, strict=True))  # the same AdamW, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(on_cpu.module.state_dict().values(),
                                                    off.module.state_dict().values(), strict=True))
    # a checkpoint taken while the state is on the host, resumed on the GPU: it goes to the host with the
    # reference at once, and the next refresh continues it as the uninterrupted run does
    buf = io.BytesIO()
    torch.save(off.state_dict(next_step=3), buf)
    buf.seek(0)
    resumed, _ = _reference("blade-nosync")
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.optimizer_at is OptimizerAt.SAVED and resumed.where is Where.NONE
    resumed.start(proxy, 3)  # fit start: the checkpoint's reference on the host, its AdamW state there too
    resumed.train_device = torch.device("cuda")
    resumed.offload()
    assert resumed.optimizer_at is OptimizerAt.HOST
    assert _same_state(_refresh(resumed, proxy, recent, 3), _refresh(on_cpu, proxy, recent, 3))
    assert all(torch.equal(a, b) for a, b in zip(on_cpu.module.state_dict().values(),
                                                    resumed.module.state_dict().values(), strict=True))


@pytest.mark.gpu
def test_blade_nosync_on_cuda_keeps_its_adamw_state_on_the_host_between_refreshes(make_config):
    """On a GPU with offloading, blade-nosync's AdamW moments leave the device with the reference (pinned host
    buffer) and come back for the next refresh: the masks and weights equal a run that keeps both on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the offload path moves the optimizer state off the GPU)")
    # 11 steps: the last episode (τ = 3 from step 8) is whole, so its reference is compacted once scored (an
    # episode cut short by max_steps stays float32 for a run extended from the checkpoint; seen at 12 on an H200)
    # refreshes at steps 2, 5 and 8 (none at 11: no episode follows it; the CPU run of this config counts 3 too)
    common = dict(max_steps=11, device="cuda", eval={"interval": 100})
    cfg = make_config("blade-nosync", "offload", **common)
    with _deterministic():
        on = train(cfg)
    ref = on.run.algorithm.reference  # after the last episode's scoring: offloaded
    assert ref.optimizer_at is OptimizerAt.HOST and ref.optimizer_host._buffer.is_pinned()
    assert not ref.workspace.optimizer.state and ref.where is Where.HOST  # kept, emptied
    state = ref.optimizer_state()
    assert state["state"] and all(t.device.type == "cpu" for t in _tensors(state))
    off_cfg = make_config("blade-nosync", "on-device", selection={"offload_reference": False}, **common)
    with _deterministic():
        off = train(off_cfg)
    kept = off.run.algorithm.reference
    assert not kept.optimizer_host.holds and kept.optimizer_host.nbytes == 0
    assert any(t.is_cuda for t in _tensors(kept.optimizer_state()))
    assert on.run.algorithm.counts["refreshes"] == off.run.algorithm.counts["refreshes"] == 3
    ma, mb = (read_column(o.selected, "loss_mask") for o in (on, off))
    assert all(np.array_equal(x, y) for x, y in zip(ma, mb, strict=True))
    # The same values are expected bit for bit (the CPU test above asserts it); the float32 tolerance only
    # leaves room for CUDA kernels that accumulate with atomics (embedding backward), which two identical runs
    # may round differently.
    live = {k: {n: v.cpu() for n, v in s.items()} for k, s in kept.optimizer_state()["state"].items()}
    torch.testing.assert_close(state["state"], live)
    for name in ("model", "reference"):
        a, b = (load_file(os.path.join(c.output_dir, "final", f"{name}.safetensors")) for c in (cfg, off_cfg))
        torch.testing.assert_close(a, b)
