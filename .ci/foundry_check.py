"""llm-foundry 0.22 against this project's selected-token shards, each in its own environment.

    python .ci/foundry_check.py                      # builds its venv with llm-foundry 0.22 once (outside the checkout)
    python .ci/foundry_check.py --venv /path/to/venv --steps 40 --out build/foundry-check

llm-foundry 0.22 pins mosaicml-streaming <0.13, mlflow <3 and transformers <4.52, so it cannot share this project's
environment: the hand-off is through files. In this environment the script runs the main job
(``jobs/curate_and_train.py``, ``--steps`` steps, in ``--out``), saves a seeded tiny Llama and the run's tokenizer as HF
directories and computes the first step's loss with our masked loss (``training.blocks.model.MaskedCausalLM``). Then,
with the venv's Python (this package installed there with ``--no-deps``, which registers the ``blade_selected``
loader through its entry point), it runs the second half of this file: ``llmfoundry.data.dataloader.build_dataloader``
builds the registered loader over ``selected/`` (streaming 0.12 reading shards streaming 0.13's format, through a
separate local cache); every batch's ``labels`` must be -100 exactly where ``loss_mask`` is 0 (and at position 0)
and the tokens elsewhere; then Composer trains llm-foundry's ``ComposerHFCausalLM`` for ``--train-steps`` steps on
that loader, and each step's loss must equal our masked mean of the same logits (and the first one, the loss computed
here). llm-foundry's stock ``text`` loader is run on the same shards for contrast (it ignores ``loss_mask``).
Not in CI: building the venv downloads torch with its CUDA libraries (several GB, minutes). The venv lives outside the
checkout (:func:`default_venv`: ``~/.cache/blade-curation/ci/foundry-0.22.0-py3.X``, or under ``$BLADE_CI_VENVS``), made
once and locked while a check uses it, so a rerun (from a fresh clone too) only reinstalls this checkout into it.
Prints one line per check and the time taken, and writes ``--out/foundry_check.json``; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOUNDRY = "llm-foundry==0.22.0"
ROWS = 8  # rows per loader batch (the demo trains 16 a step; any size reads the same rows): a batch is a step


def default_venv() -> str:
    """Outside the checkout, like .ci/second_python.sh's: ``${BLADE_CI_VENVS:-~/.cache/blade-curation/ci}``/
    ``foundry-0.22.0-py3.X``, so that a rerun, from a fresh clone too, reuses it."""
    root = os.environ.get("BLADE_CI_VENVS") or os.path.join(os.path.expanduser("~"), ".cache", "blade-curation", "ci")
    return os.path.join(root, f"foundry-{FOUNDRY.split('==')[1]}-py{sys.version_info[0]}.{sys.version_info[1]}")


def _ensure_venv(venv: str) -> str:
    """The venv with llm-foundry, made once (its file ``.ci-installed`` names what was installed; one without it, a
    first install that did not finish, is made again), and this checkout installed in it without dependencies (the
    entry point ``llmfoundry_dataloaders: blade_selected``), each time: that points it at this checkout. The caller
    holds ``venv + ".lock"``."""
    python, marker = os.path.join(venv, "bin", "python"), os.path.join(venv, ".ci-installed")
    done = open(marker, encoding="utf-8").read().strip() if os.path.exists(marker) else None
    t0 = time.time()
    if done != FOUNDRY or not os.path.exists(python):
        print(f"creating {venv} with {FOUNDRY} (downloads torch and its CUDA libraries: minutes)", flush=True)
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", FOUNDRY], check=True)
        with open(marker, "w", encoding="utf-8") as f:
            f.write(FOUNDRY + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO], check=True)
    print(f"venv {venv}: ready in {time.time() - t0:.0f} s", flush=True)
    return python


def _our_side(out: str, steps: int) -> dict:
    """The main job's shards, a seeded tiny Llama, the tokenizer as HF directories, our first-step loss."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from curation.io.shards import read_column
    from training.blocks.model import MaskedCausalLM

    run = os.path.join(out, "runs", "demo", "curate_and_train", "blade")
    if not os.path.exists(os.path.join(run, "summary.json")):
        t0 = time.time()
        subprocess.run([sys.executable, os.path.join(REPO, "jobs", "curate_and_train.py"), "--set",
                        f"train.max_steps={steps}", "--set", "train.progress_bar=false"], cwd=out, check=True)
        print(f"main job: {steps} steps in {time.time() - t0:.0f} s → {run}", flush=True)
    selected = os.path.join(run, "selected")
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "runs", "demo", "data", "tokenizer",
                                                              "tokenizer.json"), eos_token="<|endoftext|>")
    tok.pad_token = tok.eos_token
    tok.save_pretrained(os.path.join(out, "hf-tokenizer"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=128, tie_word_embeddings=False))
    model.save_pretrained(os.path.join(out, "hf-model"))
    tokens, masks = read_column(selected, "tokens")[:ROWS], read_column(selected, "loss_mask")[:ROWS]
    batch = {"tokens": torch.from_numpy(np.stack(tokens).astype(np.int64)),
             "loss_mask": torch.from_numpy(np.stack(masks).astype(bool))}
    ours = MaskedCausalLM(model.eval())
    with torch.no_grad():
        first = float(ours.loss(ours(batch), batch))
    return {"selected": selected, "tokenizer": os.path.join(out, "hf-tokenizer"),
            "model": os.path.join(out, "hf-model"), "first_loss": first}


def _foundry_side(work: dict, out: str, train_steps: int) -> dict:
    """In llm-foundry's venv: the registered loader's labels and llm-foundry's own loss over a few steps."""
    import importlib.metadata as md

    import numpy as np
    import torch
    from composer import Trainer
    from composer.core import Callback, Event
    from llmfoundry.data.dataloader import build_dataloader
    from llmfoundry.models.hf import ComposerHFCausalLM
    from llmfoundry.registry import dataloaders
    from streaming import StreamingDataset
    from transformers import AutoTokenizer

    from curation.core.losses import token_losses
    from curation.core.selection import masked_mean

    res: dict = {"versions": {p: md.version(p) for p in ("llm-foundry", "mosaicml-streaming", "mosaicml",
                                                          "transformers", "torch")}}
    res["registered"] = "blade_selected" in dataloaders.get_all()
    raw = StreamingDataset(remote=work["selected"], local=os.path.join(out, "cache-raw"), shuffle=False,
                           batch_size=ROWS, validate_hash="xxh64")
    tokens = np.stack([raw[i]["tokens"] for i in range(len(raw))]).astype(np.int64)
    masks = np.stack([raw[i]["loss_mask"] for i in range(len(raw))]).astype(bool)
    tok = AutoTokenizer.from_pretrained(work["tokenizer"])

    def loader(name: str, cache: str):
        return build_dataloader({"name": name, "dataset": {"remote": work["selected"], "local": os.path.join(out, cache),
                                                           "shuffle": False, "max_seq_len": tokens.shape[1]},
                                 "drop_last": True, "num_workers": 0, "prefetch_factor": None,
                                 "persistent_workers": False}, tok, ROWS)

    spec = loader("blade_selected", "cache-blade")
    rows, bad, loss_generating = 0, 0, 0
    for batch in spec.dataloader:
        t, m = tokens[rows:rows + ROWS], masks[rows:rows + ROWS].copy()
        m[:, 0] = False
        expected = np.where(m, t, -100)
        bad += int((batch["input_ids"].numpy() != t).sum() + (batch["labels"].numpy() != expected).sum())
        loss_generating += int(spec.get_num_tokens_in_batch(batch, token_type="loss_generating"))
        rows += ROWS
    res["loader"] = {"rows": rows, "mismatches": bad, "labelled": int(masks[:rows, 1:].sum()),
                     "loss_generating_tokens": loss_generating, "tokens": rows * int(tokens.shape[1])}
    try:  # llm-foundry's stock text loader on the same shards: labels = input_ids, the selection is lost
        trained, k = 0, 0
        for stock in loader("text", "cache-text").dataloader:
            dropped = ~masks[k:k + ROWS]
            dropped[:, 0] = False  # (position 0 is never a target for anyone)
            trained += int(((stock["labels"] != -100).numpy() & dropped).sum())
            k += ROWS
        unselected = ~masks[:k]
        unselected[:, 0] = False
        res["stock_text_loader"] = {"unselected": int(unselected.sum()), "unselected_trained": trained}
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        res["stock_text_loader_error"] = f"{type(e).__name__}: {e}"

    steps: list[dict] = []

    class LossCheck(Callback):
        def run_event(self, event, state, logger):
            if event != Event.AFTER_LOSS:
                return
            ids = state.batch["input_ids"]
            k = len(steps) * ROWS
            alpha = torch.from_numpy(masks[k:k + ids.shape[0]])
            losses, valid = token_losses(state.outputs.logits.detach().float(), ids)
            steps.append({"foundry": float(state.loss), "ours": float(masked_mean(losses, alpha & valid)),
                          "rows_match": bool((ids.numpy() == tokens[k:k + ids.shape[0]]).all())})

    model = ComposerHFCausalLM(tokenizer=tok, pretrained_model_name_or_path=work["model"], pretrained=True,
                               trust_remote_code=False, use_train_metrics=False)
    trainer = Trainer(model=model, train_dataloader=loader("blade_selected", "cache-train"),
                      max_duration=f"{train_steps}ba", optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
                      device="cpu", progress_bar=False, loggers=[], callbacks=[LossCheck()], seed=0,
                      save_folder=None)
    trainer.fit()
    res["train_steps"] = steps
    return res


def _verdict(our: dict, res: dict) -> list[tuple[str, bool, str]]:
    ld, steps = res["loader"], res["train_steps"]
    v = res["versions"]
    return [
        ("llm-foundry 0.22 with streaming 0.12", v["llm-foundry"].startswith("0.22.")
         and v["mosaicml-streaming"].startswith("0.12."), json.dumps(v)),
        ("blade_selected registered through the entry point", res["registered"], ""),
        ("labels -100 exactly where loss_mask is 0", ld["rows"] > 0 and ld["mismatches"] == 0,
         f"{ld['rows']} rows, {ld['mismatches']} mismatching positions"),
        ("llm-foundry counts the kept tokens as loss-generating", ld["loss_generating_tokens"] == ld["labelled"],
         f"{ld['loss_generating_tokens']} of {ld['tokens']} tokens"),
        ("each step's loss is our masked mean", bool(steps) and all(
            s["rows_match"] and abs(s["foundry"] - s["ours"]) <= 1e-6 * max(1.0, abs(s["ours"])) for s in steps),
         ", ".join(f"{s['foundry']:.6f}/{s['ours']:.6f}" for s in steps)),
        ("first step's loss = ours in this project's env", bool(steps) and abs(steps[0]["foundry"] - our["first_loss"])
         <= 1e-5 * max(1.0, our["first_loss"]), f"{steps[0]['foundry']:.6f} vs {our['first_loss']:.6f}" if steps
         else ""),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", default=default_venv(), help="llm-foundry's venv (made if missing; default: %(default)s)")
    p.add_argument("--out", default=os.path.join(REPO, "build", "foundry-check"), help="work directory")
    p.add_argument("--steps", type=int, default=40, help="main job steps (the demo's warm-up is 30)")
    p.add_argument("--train-steps", type=int, default=3, help="llm-foundry training steps")
    p.add_argument("--foundry-side", help=argparse.SUPPRESS)  # internal: the half run by the venv's python
    a = p.parse_args()
    out = os.path.abspath(a.out)
    if a.foundry_side:
        with open(a.foundry_side, encoding="utf-8") as f:
            work = json.load(f)
        res = _foundry_side(work, out, a.train_steps)
        with open(os.path.join(out, "foundry_side.json"), "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        return 0
    os.makedirs(out, exist_ok=True)
    venv = os.path.abspath(a.venv)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    lock = open(venv + ".lock", "w")  # noqa: SIM115 - held until this process exits: one check builds or uses it at a time
    fcntl.flock(lock, fcntl.LOCK_EX)
    t0 = time.time()
    python = _ensure_venv(venv)
    sys.path.insert(0, REPO)
    our = _our_side(out, a.steps)
    with open(os.path.join(out, "work.json"), "w", encoding="utf-8") as f:
        json.dump(our, f, indent=1)
    env = {**os.environ, "PYTHONPATH": ""}  # the venv's own packages (this checkout comes from its editable install)
    subprocess.run([python, os.path.abspath(__file__), "--foundry-side", os.path.join(out, "work.json"), "--out", out,
                    "--train-steps", str(a.train_steps)], check=True, env=env, cwd=out)
    with open(os.path.join(out, "foundry_side.json"), encoding="utf-8") as f:
        res = json.load(f)
    checks = _verdict(our, res)
    for name, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
    if "stock_text_loader" in res:
        st = res["stock_text_loader"]
        print(f"     (llm-foundry's stock text loader on the same shards: trains on {st['unselected_trained']} of the "
              f"{st['unselected']} positions loss_mask excludes)")
    else:
        print(f"     (llm-foundry's stock text loader: {res.get('stock_text_loader_error')})")
    with open(os.path.join(out, "foundry_check.json"), "w", encoding="utf-8") as f:
        json.dump({"ours": our, "foundry": res, "checks": {n: ok for n, ok, _ in checks}}, f, indent=1)
    passed = all(ok for _, ok, _ in checks)
    print(f"foundry check: {'passed' if passed else 'FAILED'} in {time.time() - t0:.0f} s "
          f"({time.strftime('%Y-%m-%d')}, venv {venv})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
