"""Evaluate trained models on local evaluation sets: whole-document token loss with 95% bootstrap intervals.

    python jobs/prepare.py && python jobs/train.py && python jobs/evaluate.py   # demo runs on the target set
    python jobs/evaluate.py --set 'models=[{path: runs/demo/curate_and_train/blade}]'   # the main job's run
    python jobs/evaluate.py --set 'models=[{path: runs/quality/models/blade-seed0}, {path: runs/q/runs/full-seed0}]' \\
        --set 'sets=[{name: gsm8k_test, paths: [../shared/data/gsm8k/test.jsonl], template: "{question}\\n{answer}"}]'
    python jobs/evaluate.py --config my_eval.yaml --set lm_eval.gsm8k_file=../shared/data/gsm8k/test.jsonl

Models: HF directories (save_pretrained + tokenizer) or training runs (output_dir or final/, with the run's
tokenizer); a glob names several. Sets: the source spec of jobs/prepare.py. Writes results.json (means,
intervals, paired differences, per-document scores) and results.md under output_dir. With `lm_eval` set,
also accuracy through lm-evaluation-harness, offline (pip install -e ".[eval]").
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.io.atomic import atomic_write_text  # noqa: E402
from curation.io.cli import parse_job_config  # noqa: E402
from schemas.eval_config import EvaluateConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_job_config(EvaluateConfig, description=__doc__.splitlines()[0],
                              default=EvaluateConfig.demo_default, argv=argv)
    # Imported after the config is parsed (torch and transformers take seconds): --help and bad settings answer at once.
    import torch

    from curation.evaluation.harness import run_harness  # (imports lm_eval only when called)
    from curation.evaluation.heldout import (
        EvalError,
        evaluate_models,
        export_hf,
        load_model,
        resolve_models,
        results_markdown,
    )

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    try:
        refs = resolve_models(cfg.models)
        res = evaluate_models(refs, cfg, device=device)
        if cfg.lm_eval is not None:
            dirs = {}
            for ref in refs:  # the harness loads HF directories: export runs (and other weights) as one
                if ref.weights is None and os.path.isfile(os.path.join(ref.model_dir, "tokenizer.json")):
                    dirs[ref.name] = ref.model_dir
                else:
                    model, tok = load_model(ref, eos_token=cfg.eos_token)
                    dirs[ref.name] = export_hf(model, tok.path, os.path.join(cfg.output_dir, "hf", ref.name),
                                               eos_token=cfg.eos_token)
            res["lm_eval"] = run_harness(dirs, cfg.lm_eval, os.path.join(cfg.output_dir, "lm_eval_tasks"),
                                         device=device)
    except (EvalError, ImportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    res["config"] = cfg.model_dump(mode="json")
    os.makedirs(cfg.output_dir, exist_ok=True)
    atomic_write_text(os.path.join(cfg.output_dir, "results.json"), json.dumps(res, indent=1))
    md = results_markdown(res)
    atomic_write_text(os.path.join(cfg.output_dir, "results.md"), md)
    print(md)
    print(f"results: {os.path.join(cfg.output_dir, 'results.json')}, {os.path.join(cfg.output_dir, 'results.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
