"""Train another model (e.g. wider/deeper) on selected-token shards: the paper's BLADE-Tr transfer.

    python jobs/train.py && python jobs/replay.py         # demo: blade's selected tokens → a bigger Llama
    python jobs/replay.py --set selected=runs/demo/train/rho1/selected --set output_dir=runs/demo/replay/rho1
    python jobs/replay.py --config jobs/configs/replay_demo.yaml --set model.hf_config.num_hidden_layers=4

A plain masked-loss Composer trainer: no scoring, no reference; the loss honours each row's loss_mask.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.io.cli import parse_job_config
from curation.io.objects import is_url
from curation.io.outdir import report_job_errors
from curation.io.stop import GracefulStop, StopRequested, exit_code
from schemas.train_config import ReplayConfig


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_job_config(ReplayConfig, description=__doc__.splitlines()[0],
                                 default=ReplayConfig.demo_default, argv=argv,
                                 set_example="model.hf_config.num_hidden_layers=4 --set output_dir=runs/demo/replay/deep")
    if not is_url(cfg.selected) and not os.path.exists(os.path.join(cfg.selected, "index.json")):
        print(f"error: no selected-token shards in {cfg.selected}; run `python jobs/train.py` first", file=sys.stderr)
        return 1
    # Imported after the config is parsed (Composer takes seconds): --help and bad settings answer at once; and
    # before the stop handler is installed (importing Composer installs its own, which would replace it).
    from training.runs.train_job import replay

    try:  # SIGTERM / SIGINT: training ends after the step in progress, with a checkpoint there (a second: at once)
        with GracefulStop(what="the training step in progress and its checkpoint"):
            out = report_job_errors(lambda: replay(cfg), f"replaying into {cfg.output_dir} failed")
    except StopRequested as e:
        print(e, file=sys.stderr)
        return exit_code(e.signum)
    if out is None:
        return 1
    params = sum(p.numel() for p in out.run.model.parameters())
    from curation.io.storage import display  # an object-store run's paths as its s3:// URLs, not cache paths

    print(f"replayed {display(cfg.selected)} into a {params:,}-parameter model ({cfg.model.hf_config or cfg.model.path})")
    if out.validation:
        first, last = out.validation[0], out.validation[-1]
        print(f"validation loss: {first['loss']:.3f} (step {first['step']}) → {last['loss']:.3f} (step {last['step']})")
    print(f"final weights: {display(out.final_weights)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
