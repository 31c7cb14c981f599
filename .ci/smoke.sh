#!/usr/bin/env bash
# End-to-end smoke of the jobs on one interpreter, in a temporary directory (removed at the end):
#   prepare the demo corpus → read it back through streaming.StreamingDataset → jobs/train.py for a few
#   blade steps (one refresh) → the Ray main job jobs/curate_and_train.py for a few steps (2 scoring workers,
#   a local Ray instance of its own). Each step prints its time; any failure stops the script.
# usage: .ci/smoke.sh [PYTHON]   (default: python; CI passes the second interpreter's virtualenv)
set -euo pipefail
PY=${1:-python}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/blade-smoke.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # the jobs' embedded defaults read and write under ./runs/demo
export TOKENIZERS_PARALLELISM=false
unset RAY_ADDRESS  # a fresh local Ray instance, never a cluster this shell happens to point at

step() {
    local name=$1 t=$SECONDS
    shift
    echo "smoke: $name ..."
    "$@"
    echo "smoke: $name ok ($((SECONDS - t)) s)"
}

# few steps, but W = 2, τ = 3, K = 2: the reference is refreshed twice
SMALL=(selection.warmup_steps=2 selection.tau=3 selection.refresh_steps=2 max_steps=8 threads=1
       eval.interval=4 eval.max_batches=1 checkpoint.interval=4 progress_bar=false plots=false)
sets() { local prefix=$1 kv; shift; for kv in "$@"; do printf -- '--set\n%s%s\n' "$prefix" "$kv"; done; }

step "prepare (demo corpus)" "$PY" "$REPO/jobs/prepare.py" --set progress=false

step "StreamingDataset reads the candidates" "$PY" - <<'EOF'
from streaming import StreamingDataset
ds = StreamingDataset(local="runs/demo/data/candidates", shuffle=False, batch_size=8, validate_hash="xxh64")
first, last = ds[0], ds[len(ds) - 1]
assert len(first["tokens"]) == 128 and len(last["tokens"]) == 128, (len(first["tokens"]), len(last["tokens"]))
print(f"  {len(ds)} candidate sequences of 128 tokens")
EOF

mapfile -t TRAIN_SETS < <(sets "" "${SMALL[@]}")
step "jobs/train.py (blade, 8 steps)" "$PY" "$REPO/jobs/train.py" "${TRAIN_SETS[@]}" --set "output_dir=$WORK/train"

mapfile -t CAT_SETS < <(sets "train." "${SMALL[@]}")
step "jobs/curate_and_train.py (Ray, 8 steps)" "$PY" "$REPO/jobs/curate_and_train.py" "${CAT_SETS[@]}" \
    --set "train.output_dir=$WORK/curate_and_train" --set ray.address=local --set ray.num_cpus=4 \
    --set workers.count=2 --set workers.range_steps=2 --set engine.lookahead=4

step "outputs" "$PY" - "$WORK" <<'EOF'
import json, os, sys
for run in ("train", "curate_and_train"):
    with open(os.path.join(sys.argv[1], run, "summary.json")) as f:
        s = json.load(f)
    assert s["steps"] == 8 and len(s["refreshes"]) >= 2, (run, s["steps"], s["refreshes"])
    for name in ("model.safetensors", "reference.safetensors"):
        assert os.path.isfile(os.path.join(sys.argv[1], run, "final", name)), (run, name)
    print(f"  {run}: {s['steps']} steps, {len(s['refreshes'])} refreshes, final weights written")
EOF
