#!/usr/bin/env bash
# CI's second stage: the newest other interpreter of the supported range (pyproject's requires-python) found
# on this machine gets its own virtualenv, README's install, the fast suite (`python -m pytest`) and, alongside it,
# the jobs' end-to-end smoke (.ci/smoke.sh). Without such an interpreter it says so and succeeds.
# The virtualenv lives outside the checkout, in ${BLADE_CI_VENVS:-~/.cache/blade-curation/ci}/py3.X, so that
# the next CI, in a fresh clone too, reuses it (pip brings it up to date and points the editable install at
# this checkout; unpacking torch again took 368 s of a 578-s stage); a lock keeps two CIs from sharing it at
# once, and one whose first install did not finish (no .ci-installed in it) is made again. rm -rf that folder
# for a fresh one.
# Interpreters are looked up as python3.X on PATH (run once: a pyenv shim of a version that is not
# selected fails), then under `pyenv root`/versions/3.X*/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT=${PYTHON:-python}

# supported minor versions, newest first, without the default interpreter's
want=$("$DEFAULT" - <<'EOF'
import re, sys, tomllib
spec = tomllib.load(open("pyproject.toml", "rb"))["project"]["requires-python"]
lo, hi = int(re.search(r">=\s*3\.(\d+)", spec)[1]), int(re.search(r"<\s*3\.(\d+)", spec)[1])
print(" ".join(f"3.{m}" for m in range(hi - 1, lo - 1, -1) if m != sys.version_info.minor))
EOF
)
read -ra WANT <<< "$want"

works() {  # works PYTHON VERSION: PYTHON runs, is that version and can make a virtualenv
    [ "$("$1" -c 'import sys, venv, ensurepip; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$2" ]
}

PY="" VERSION=""
for v in "${WANT[@]}"; do
    candidates=()
    if c=$(command -v "python$v"); then candidates+=("$c"); fi
    if command -v pyenv >/dev/null; then
        for c in "$(pyenv root)/versions/$v"*/bin/"python$v"; do [ -e "$c" ] && candidates+=("$c"); done
    fi
    for c in "${candidates[@]}"; do
        if works "$c" "$v"; then PY=$c VERSION=$v; break 2; fi
    done
done
if [ -z "$PY" ]; then
    echo "ci: no other interpreter of the supported range (${WANT[*]:-none}) on this machine; second stage skipped"
    exit 0
fi

VENVS=${BLADE_CI_VENVS:-$HOME/.cache/blade-curation/ci}
VENV=$VENVS/py$VERSION
mkdir -p "$VENVS"
exec 9>"$VENV.lock"
flock 9  # held until this script exits
echo "ci: second interpreter $PY ($("$PY" --version 2>&1)) → $VENV"
t=$SECONDS
if [ ! -x "$VENV/bin/python" ] || [ ! -e "$VENV/.ci-installed" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -e ".[dev,eval,tensorboard,mlflow,wandb]"
touch "$VENV/.ci-installed"
install=$((SECONDS - t)); t=$SECONDS
# The smoke runs alongside the fast suite: the suite leaves about a quarter of the two cores idle (its tests wait on
# the processes they start), the smoke runs one job at a time. Its output is printed when both have ended.
SMOKE_LOG=$(mktemp "${TMPDIR:-/tmp}/blade-ci-smoke.XXXXXX")
trap 'rm -f "$SMOKE_LOG"' EXIT
(
    s=$SECONDS
    if PATH="$VENV/bin:$PATH" .ci/smoke.sh "$VENV/bin/python"; then echo "smoke: done in $((SECONDS - s)) s"
    else rc=$?; echo "smoke: FAILED (exit $rc)"; exit "$rc"; fi
) > "$SMOKE_LOG" 2>&1 &
smoke_pid=$!
fast_rc=0
"$VENV/bin/python" -m pytest || fast_rc=$?
fast=$((SECONDS - t))
smoke_rc=0
wait "$smoke_pid" || smoke_rc=$?
both=$((SECONDS - t))
cat "$SMOKE_LOG"
echo "ci: python $VERSION: install ${install} s, fast suite ${fast} s (exit $fast_rc), smoke alongside it (exit $smoke_rc), both ${both} s"
[ "$fast_rc" -eq 0 ] && [ "$smoke_rc" -eq 0 ]
