"""Optional accuracy through lm-evaluation-harness, fully offline (``pip install -e ".[eval]"``).

Task YAMLs are written next to the results and read local files only (``dataset_path: json`` with
``data_files``); models are HF directories (``save_pretrained`` + tokenizer, see
:func:`curation.evaluation.heldout.export_hf`). Nothing is downloaded: the Hugging Face hub and datasets are put
in offline mode before lm_eval is imported. No ray, no composer.
"""

from __future__ import annotations

import os
from typing import Any

from curation.io.atomic import atomic_write_text
from schemas.eval_config import LmEvalConfig

__all__ = ["HARNESS_MISSING", "harness_available", "write_gsm8k_task", "run_harness"]

HARNESS_MISSING = 'lm-evaluation-harness is not installed; install the extra: pip install -e ".[eval]"'

# GSM8K (generate, then exact match on the number after "####"), after lm-eval's own gsm8k.yaml, reading
# a local jsonl. {data_file}, {max_gen_toks} and {num_fewshot} are filled in by write_gsm8k_task.
_GSM8K_YAML = """\
task: gsm8k_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
fewshot_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:", "<|endoftext|>", "\\n\\n"]
  do_sample: false
  max_gen_toks: {max_gen_toks}
repeats: 1
num_fewshot: {num_fewshot}
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metadata:
  version: 3.0
"""


def harness_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def write_gsm8k_task(task_dir: str, data_file: str, *, max_gen_toks: int = 256, num_fewshot: int = 0) -> str:
    """Write the ``gsm8k_local`` task YAML reading ``data_file`` (question/answer jsonl). Returns its path.

    Raises:
        FileNotFoundError: ``data_file`` does not exist.
    """
    if not os.path.isfile(data_file):
        raise FileNotFoundError(f"lm_eval.gsm8k_file: no such file {data_file}")
    path = os.path.join(task_dir, "gsm8k_local.yaml")
    os.makedirs(task_dir, exist_ok=True)
    atomic_write_text(path, _GSM8K_YAML.format(data_file=os.path.abspath(data_file), max_gen_toks=max_gen_toks,
                                               num_fewshot=num_fewshot))
    return path


def run_harness(model_dirs: dict[str, str], cfg: LmEvalConfig, task_dir: str, *,
                device: str = "cpu") -> dict[str, dict[str, dict[str, float]]]:
    """Run the configured tasks on each HF model directory, offline.

    Returns:
        model name → task → metric (``exact_match,strict-match``, …) → value.

    Raises:
        ImportError: lm_eval is not installed (the message names the extra).
    """
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError(HARNESS_MISSING) from e
    write_gsm8k_task(task_dir, cfg.gsm8k_file, max_gen_toks=cfg.max_gen_toks, num_fewshot=cfg.num_fewshot)
    manager = TaskManager(include_path=task_dir)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, d in model_dirs.items():
        res: dict[str, Any] = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": d, "tokenizer": d, "dtype": "float32"}, tasks=list(cfg.tasks),
            num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, limit=cfg.limit, device=device,
            task_manager=manager, log_samples=False,
        )
        out[name] = {task: {k: v for k, v in metrics.items() if k != "alias" and isinstance(v, int | float)}
                     for task, metrics in res["results"].items()}
    return out
