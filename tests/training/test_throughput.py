"""training.blocks.throughput: tokens/s, kept tokens/s, MFU (with and without the reference's work) and the time
left, against hand-computed values; in the JSON log, the progress bar and summary.json of plain and BLADE runs."""

from __future__ import annotations

import json
import os

import pytest
from composer.core import Callback
from composer.loggers import ProgressBarLogger

from curation.core.schedule import Schedule
from curation.evaluation.flops import ModelShape, forward_flops_per_token
from training.blocks import throughput
from training.blocks.throughput import (
    ReferenceWork,
    Remaining,
    eta_seconds,
    format_seconds,
    remaining_work,
)
from training.runs.train_job import build_replay, train

# the tiny Llama of tests/training/conftest.py (hidden 32, 1 layer, 2 heads, intermediate 88, vocab 512) at L = 128:
# q, k, v, o 4·32² + gated MLP 3·32·88 + head 32·512 = 28,928 matmul weights; 2·28,928 + attention 2·1·128·32
F = 2 * (4 * 32 * 32 + 3 * 32 * 88 + 32 * 512) + 2 * 1 * 128 * 32
STEPS, B, L = 11, 8, 128
PEAK = 1e11


def test_forward_flops_of_the_tiny_model():
    assert F == 66048
    shape = ModelShape(hidden=32, layers=1, intermediate=88, vocab=512, context=L)
    assert shape.matmul_weights == 28928


def test_remaining_work_and_eta_by_hand():
    schedule = Schedule(2, 3, STEPS)  # refreshes before steps 2, 5, 8; scored steps 2..10
    left = remaining_work(4, STEPS, schedule=schedule, refreshes=True, scores=True, eval_interval=5)
    assert left == Remaining(steps=7, refreshes=2, scored_steps=7, evaluations=3)  # refreshes 5, 8; evals 5, 10, 11
    assert remaining_work(0, STEPS, schedule=schedule, refreshes=True, scores=True) == Remaining(11, 3, 9, 0)
    assert remaining_work(STEPS, STEPS, schedule=schedule, refreshes=True, scores=True, eval_interval=5) == \
        Remaining(0, 0, 0, 0)
    assert remaining_work(4, STEPS) == Remaining(7, 0, 0, 0)  # a plain run: steps only
    # 7 steps × 0.5 s + 2 refreshes × 3 s + 7 scored steps × 0.1 s + 3 evaluations × 2 s
    assert eta_seconds(left, step_s=0.5, refresh_s=3.0, score_s=0.1, eval_s=2.0) == pytest.approx(16.2)
    assert [format_seconds(s) for s in (0.4, 12, 65, 3600 + 125, 7322)] == ["0s", "12s", "1m05s", "1h02m", "2h02m"]


def test_reference_work_by_hand(make_config):
    shape = ModelShape(hidden=32, layers=1, intermediate=88, vocab=512, context=L)
    cfg = make_config("blade")  # refresh batches of 2 sequences, λ = 1: a validation and a candidate batch
    work = ReferenceWork.of(cfg, rows=B, seq_len=L, static=False)
    assert (work.score_tokens, work.refresh_tokens, work.refresh_steps, work.refreshes) == (B * L, 2 * 2 * L, 2, True)
    log = [{"steps": 2}, {"steps": 2}]
    assert work.flops(forward_flops_per_token(shape), {"score_steps": 5}, log) == F * 5 * B * L + 3 * F * 4 * 2 * 2 * L
    rho1 = ReferenceWork.of(make_config("rho1"), rows=B // 2, seq_len=L, static=True)  # validation batches only
    assert (rho1.score_tokens, rho1.refresh_tokens, rho1.refreshes) == (B // 2 * L, 2 * L, False)
    no_lam = ReferenceWork.of(make_config("blade", selection={"lam": 0.0}), rows=B, seq_len=L, static=False)
    assert no_lam.refresh_tokens == 2 * L


class _Bar(Callback):
    """What the training progress bar shows after each step (read after the step's callbacks)."""

    def __init__(self) -> None:
        self.shown: list[dict] = []

    def batch_checkpoint(self, state, logger) -> None:
        for d in logger.destinations:
            if isinstance(d, ProgressBarLogger) and d.train_pbar is not None:
                self.shown.append(dict(d.train_pbar.metrics))


def _log(out: str) -> list[dict]:
    with open(os.path.join(out, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if '"hyperparameters"' not in line]


def test_blade_run_throughput_in_log_bar_and_summary(make_config, monkeypatch):
    """The reference's work (9 scored steps, 3 refreshes of K = 2 steps) counted apart; MFU against a given peak."""
    monkeypatch.setattr(throughput, "interactive", lambda: True)  # (a terminal: the bar, not progress lines)
    cfg = make_config("blade", progress_bar=True, throughput={"peak_flops": PEAK, "window": 3})
    bar = _Bar()
    out = train(cfg, callbacks=[bar])
    s = json.load(open(out.summary, encoding="utf-8"))
    tp = s["throughput"]
    tokens = STEPS * B * L
    proxy = 3.0 * F * tokens
    reference = F * 9 * B * L + 3.0 * F * (3 * 2) * (2 * 2 * L)
    assert (tp["steps"], tp["tokens"], s["world_size"]) == (STEPS, tokens, 1) and "world_size" not in tp
    assert tp["kept_tokens"] == s["tokens"]["kept"] < tokens
    assert tp["forward_flops_per_token"] == F and tp["proxy_flops"] == proxy
    assert tp["reference_flops_per_device"] == reference
    seconds = tp["train_seconds"]
    assert seconds > 0 and tp["peak_flops_per_device"] == PEAK
    assert tp["tokens_per_sec"] == pytest.approx(tokens / seconds)
    assert tp["kept_tokens_per_sec"] == pytest.approx(tp["kept_tokens"] / seconds)
    assert tp["mfu"] == pytest.approx(proxy / seconds / PEAK)
    assert tp["mfu_with_reference"] == pytest.approx((proxy + reference) / seconds / PEAK)
    assert tp["reference_seconds"] == {"score": s["seconds"]["score"], "refresh": s["seconds"]["refresh"]}

    log = _log(cfg.output_dir)
    speed = [r for r in log if "throughput/flops_per_sec" in r]  # Composer's SpeedMonitor, window of 3 steps
    assert [r["step"] for r in speed] == list(range(4, STEPS + 1))
    for r in log:
        if "throughput/tokens_per_sec" in r:
            flops = next(x for x in speed if x["step"] == r["step"])["throughput/flops_per_sec"]
            assert flops == pytest.approx(3 * F * r["throughput/tokens_per_sec"])  # the model's flops_per_batch
    for r in speed:
        mfu = next(x for x in log if x["step"] == r["step"] and "throughput/device/mfu" in x)
        assert mfu["throughput/device/mfu"] == pytest.approx(r["throughput/flops_per_sec"] / PEAK)
    ours = [r for r in log if "throughput/kept_tokens_per_sec" in r]
    assert [r["step"] for r in ours] == list(range(4, STEPS + 1))  # the same window
    assert all(r["throughput/device/mfu_with_reference"] > 0 for r in ours)
    eta = [r["time/eta_seconds"] for r in log if "time/eta_seconds" in r]
    assert len(eta) == STEPS - 1 and eta[0] > 0 and eta[-1] == 0.0  # from the second step end; nothing left at the end
    refresh = [r for r in log if "blade/refresh_seconds" in r]  # the steps whose batch came after a refresh
    assert [r["step"] for r in refresh] == [3, 6, 9] and all(r["blade/refresh_seconds"] > 0 for r in refresh)
    assert sum(r["blade/refresh_seconds"] for r in refresh) == pytest.approx(s["seconds"]["refresh"])

    assert len(bar.shown) == STEPS
    assert {"tok/s", "kept/s", "mfu", "eta"} <= set(bar.shown[-1]) and bar.shown[-1]["eta"] == "0s"
    assert list(bar.shown[-1])[:4] == ["tok/s", "kept/s", "mfu", "eta"]  # first: a narrow console shows them
    assert out.run.throughput.lines_every is None  # no progress lines beside the bar


def test_a_cpu_run_on_a_gpu_machine_has_no_peak_but_a_configured_one_is_kept(make_config, monkeypatch):
    """Composer's table looks a peak up for any visible GPU (as on a GPU machine, simulated here): a run on its CPU
    has none (no MFU against the GPU's peak); ``throughput.peak_flops`` is kept on any device."""
    import composer.callbacks.speed_monitor as speed_monitor

    monkeypatch.setattr(speed_monitor, "get_gpu_flops_available", lambda state: 989e12)  # an H100's bf16 peak
    out = train(make_config("full", "cpu-on-gpu-machine", max_steps=3, throughput={"window": 2}))
    tp = json.load(open(out.summary, encoding="utf-8"))["throughput"]
    assert tp["peak_flops_per_device"] is None and tp["mfu"] is None
    out = train(make_config("full", "given-peak", max_steps=3, throughput={"window": 2, "peak_flops": 1e12}))
    tp = json.load(open(out.summary, encoding="utf-8"))["throughput"]
    assert tp["peak_flops_per_device"] == 1e12 and tp["mfu"] > 0


def test_plain_run_and_replay_without_a_known_peak(make_config, tmp_path):
    """``full`` (plain steps): no reference work; on a CPU without ``throughput.peak_flops`` no MFU. Replay (plain
    masked steps) logs its throughput too, its kept tokens being the shards' masks."""
    cfg = make_config("full", max_steps=6, throughput={"window": 2})
    out = train(cfg)
    tp = json.load(open(out.summary, encoding="utf-8"))["throughput"]
    assert tp["tokens"] == tp["kept_tokens"] + 6 * B  # every valid token (position 0 of a row predicts nothing)
    assert tp["mfu"] is None and tp["mfu_with_reference"] is None and tp["peak_flops_per_device"] is None
    assert tp["proxy_flops"] == 3.0 * F * 6 * B * L and tp["reference_flops_per_device"] == 0.0
    log = _log(cfg.output_dir)
    assert not any("throughput/device/mfu" in r or "time/refresh_seconds" in r for r in log)
    assert any("throughput/tokens_per_sec" in r for r in log) and any("throughput/kept_tokens_per_sec" in r for r in log)

    from schemas.train_config import ReplayConfig

    blade = train(make_config("blade", "blade-src", max_steps=6))
    rcfg = ReplayConfig.demo_default(os.path.dirname(cfg.output_dir))
    rcfg = ReplayConfig.model_validate({**rcfg.model_dump(), "selected": blade.selected,
                                        "validation": None, "tokenizer": None, "model": cfg.model.model_dump(),
                                        "output_dir": str(tmp_path / "replay"), "batch_size": B, "threads": 1,
                                        "device": "cpu", "progress_bar": False, "throughput": {"window": 2}})
    run = build_replay(rcfg)
    run.fit()
    summary = run.throughput.summary(run.trainer.state)
    blade_kept = json.load(open(blade.summary, encoding="utf-8"))["tokens"]["kept"]
    assert summary["kept_tokens"] == blade_kept and summary["tokens"] == 6 * B * L  # one epoch of 6 steps
    assert any("throughput/kept_tokens_per_sec" in r for r in _log(rcfg.output_dir))


#: The tiny GPT-2 of the measured-FLOPs test (no analytic formula): h = 32, 1 layer, vocab 512, n_positions 128.
GPT2 = {"model_type": "gpt2", "vocab_size": 512, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 128}
# every matrix product of its eager forward per token: qkv + out 4·h², MLP 8·h², head h·V (2 FLOPs each), and the
# attention scores and values over the whole L × L square, 2 · 2 · L · h per layer
G = 2 * (12 * 32 * 32 + 32 * 512) + 4 * 1 * L * 32


def test_a_model_without_a_flops_formula_has_a_measured_count_and_its_mfu(make_config):
    from schemas.train_config import TrainModelConfig

    cfg = make_config("full", "gpt2", max_steps=4, throughput={"window": 2, "peak_flops": PEAK})
    cfg = cfg.model_copy(update={"model": TrainModelConfig(hf_config=GPT2)})
    out = train(cfg)
    tp = json.load(open(out.summary, encoding="utf-8"))["throughput"]
    assert G == 73728 and tp["forward_flops_per_token"] == G
    assert (tp["flops_method"], tp["flops_unavailable"]) == ("measured", None)
    assert tp["proxy_flops"] == 3.0 * G * 4 * B * L
    assert tp["mfu"] == pytest.approx(tp["proxy_flops"] / tp["train_seconds"] / PEAK)
    speed = [r for r in _log(cfg.output_dir) if "throughput/flops_per_sec" in r]
    assert speed and all(r["throughput/flops_per_sec"] == pytest.approx(3 * G * r["throughput/tokens_per_sec"])
                         for r in speed if "throughput/tokens_per_sec" in r)


def test_a_model_whose_flops_cannot_be_measured_says_why_instead_of_a_silent_null(make_config, monkeypatch, capsys):
    from schemas.train_config import TrainModelConfig

    def fails(model, context):
        raise RuntimeError("data-dependent control flow\nmore lines")

    monkeypatch.setattr(throughput, "measured_forward_flops_per_token", fails)
    cfg = make_config("full", "unmeasured", max_steps=3, throughput={"window": 2, "peak_flops": PEAK})
    out = train(cfg.model_copy(update={"model": TrainModelConfig(hf_config=GPT2)}))
    tp = json.load(open(out.summary, encoding="utf-8"))["throughput"]
    why = ("the FLOPs of GPT2LMHeadModel could not be measured (its forward on fake tensors failed: RuntimeError: "
           "data-dependent control flow): no FLOPs or MFU for this run")
    assert tp["flops_unavailable"] == why and tp["forward_flops_per_token"] is None and tp["mfu"] is None
    assert capsys.readouterr().err.count(f"note: {why}") == 1  # once, not once per step
    assert not any("throughput/flops_per_sec" in r or "throughput/device/mfu" in r for r in _log(cfg.output_dir))
