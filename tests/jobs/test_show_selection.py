"""``jobs/show_selection.py`` (issue 57): the page of a real run, loaded in a real headless Chromium (Debian's
``chromium`` driven by Playwright; skipped, naming what is missing, without them: ``.ci/run`` installs the browser).

Two tiny runs on the same candidates (blade, rho1; 14 steps each) are trained once for the module. The page's token
view is checked against the selected shards read independently (rows, steps, sources, kept tokens), its curves are
counted, its filters are used; the two-run page's overlap is recomputed from both runs' shards; a run in a bucket (a
real SeaweedFS S3 server) gives the same page and gets it uploaded beside its outputs."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from curation.io.shards import ShardReader
from schemas.train_config import TrainConfig
from tests.conftest import load_job

pytestmark = pytest.mark.slow

#: The charts every training run's page has, by id.
CHARTS = ("chart-share", "chart-threshold", "chart-delta", "chart-validation", "chart-distance")


@pytest.fixture(scope="module")
def runs(tiny_train, tmp_path_factory):
    """blade and rho1, 14 steps each, on the same candidates (the same stream: the same rows at every step); selected
    parts of 5 steps (the checkpoint interval); ‖u − w̃‖ every 2 steps (its default, the log interval of 10 steps,
    would measure it once in 14 steps: no curve)."""
    from training.runs.train_job import train

    root = tmp_path_factory.mktemp("inspected")
    out = {}
    for policy in ("blade", "rho1"):
        cfg = TrainConfig.model_validate(tiny_train(str(root / policy), selection={"policy": policy},
                                                       distance_interval=2))
        train(cfg)
        out[policy] = cfg.output_dir
    return out


def _browser():
    """A Playwright browser on the system's Chromium (its own download is not used), or a skip naming what is
    missing."""
    exe = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if exe is None:
        pytest.skip("the page test needs Chromium: apt-get install chromium (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the page test needs Playwright: pip install -e "
                                   "'.[dev]' (playwright drives the system's Chromium)")
    return sync_api, exe


class Loaded:
    """A page loaded in Chromium, with what its console said."""

    def __init__(self, page, errors):
        self.page, self.errors = page, errors

    def js(self, expr: str, arg=None):
        return self.page.evaluate(expr, arg)


@pytest.fixture(scope="module")
def chromium():
    sync_api, exe = _browser()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            def load(path: str) -> Loaded:
                page = browser.new_page(viewport={"width": 1360, "height": 900})
                errors: list[str] = []
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                           else (errors.append(f"network request: {route.request.url}"), route.abort()))
                page.goto(f"file://{os.path.abspath(path)}")
                page.wait_for_load_state("load")
                return Loaded(page, errors)

            yield load
        finally:
            browser.close()


def _show(argv, capsys) -> tuple[int, str, str]:
    code = load_job("show_selection", "_t").main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _shard_rows(selected: str) -> list[dict]:
    reader = ShardReader(selected)
    return [reader[i] for i in range(len(reader))]


def test_the_page_shows_the_kept_tokens_of_the_shards(runs, chromium, capsys):
    run = runs["blade"]
    code, out, err = _show([run, "--positions", "100"], capsys)
    assert code == 0, err
    (line,) = out.splitlines()
    assert re.match(r"blade \(train, 14 steps\): kept [\d,]+ of [\d,]+ candidates .*14 of 14 steps read; page "
                    rf"{re.escape(os.path.join(run, 'selection', 'index.html'))} \(\d+ KiB, [\d.]+ s\)$", line), line
    assert re.search(r"^show_selection: ([\d]+)/\1 tokens \(100%\)", err, re.M), err  # progress lines (no terminal here), not a bar's carriage returns
    assert "\r" not in err
    html = open(os.path.join(run, "selection", "index.html"), encoding="utf-8").read()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # self-contained: nothing from elsewhere

    page = chromium(os.path.join(run, "selection", "index.html"))
    assert page.errors == []
    rows = page.js("""() => [...document.querySelectorAll('.tokenview .row')].map(r => ({
        row: +r.dataset.row, step: +r.dataset.step, source: r.dataset.source,
        kept: r.querySelectorAll('.toks span.k').length, shown: r.querySelectorAll('.toks span').length}))""")
    shards = _shard_rows(os.path.join(run, "selected"))
    # independently: at each shown step, the first 2 rows of every source, their kept tokens among the first 100
    steps = sorted({r["step"] for r in rows})
    assert steps[0] == 0 and steps[-1] == 13 and len(steps) == 6
    want = []
    for step in steps:
        taken: dict[str, int] = {}
        for i, s in enumerate(shards):
            if int(s["step"]) == step and taken.get(s["source"], 0) < 2:
                taken[s["source"]] = taken.get(s["source"], 0) + 1
                want.append({"row": i, "step": step, "source": s["source"],
                             "kept": int(np.asarray(s["loss_mask"])[:100].sum()), "shown": 100})
    assert rows == want
    assert page.js("() => +document.getElementById('tokenview').dataset.kept") == sum(w["kept"] for w in want)
    for chart in CHARTS:  # the curves exist
        assert page.js(f"() => document.querySelectorAll('#{chart} path.curve').length") >= 1, chart
    episodes = {int(s["episode"]) for s in shards if int(s["episode"]) >= 0}
    assert page.js("() => document.querySelectorAll('#chart-delta path.curve').length") == len(episodes)
    # the filters: one source, then one step of it
    source = want[0]["source"]
    page.page.select_option("#f-source", source)
    shown = page.js("() => [...document.querySelectorAll('.tokenview .row')].filter(r => !r.hidden)"
                    ".map(r => r.dataset.source)")
    assert shown == [w["source"] for w in want if w["source"] == source]
    page.page.select_option("#f-step", str(steps[2]))
    assert page.js("() => document.getElementById('f-count').textContent") == \
        f"{sum(1 for w in want if w['source'] == source and w['step'] == steps[2])} rows shown"
    assert page.errors == []


def test_a_run_larger_than_the_budget_is_read_at_parts_spread_over_it(runs, chromium, capsys):
    """Parts of 5 × 8 × 128 = 5,120 tokens: a budget of 11,000 reads two of the three (the first and the last); the
    page and the summary say so, the token view's steps are among them, and the kept tokens per source are still the
    whole run's (the manifest's)."""
    run = runs["blade"]
    out_page = os.path.join(os.path.dirname(run), "budget", "index.html")
    code, out, err = _show([run, "--max-tokens", "11000", "--no-progress", "--out", out_page], capsys)
    assert code == 0, err
    assert "; 9 of 14 steps read; " in out
    page = chromium(out_page)
    assert page.errors == []
    assert "9 of 14 steps read (2 of 3 parts, spread over the run)" in page.js("() => document.body.innerText")
    steps = set(page.js("() => [...document.querySelectorAll('.tokenview .row')].map(r => +r.dataset.step)"))
    assert steps and steps <= set(range(0, 5)) | set(range(10, 14))
    shards = _shard_rows(os.path.join(run, "selected"))
    kept = {}
    for s in shards:
        kept[s["source"]] = kept.get(s["source"], 0) + int(np.asarray(s["loss_mask"]).sum())
    table = page.js("() => [...document.querySelectorAll('table')[0].querySelectorAll('tr')].slice(1)"
                    ".map(r => [r.cells[0].textContent, r.cells[2].textContent])")
    assert {src: int(k.replace(",", "")) for src, k in table} == kept
    # the threshold curve breaks over the steps not read: two pieces
    assert page.js("() => document.querySelectorAll('#chart-threshold path.curve').length") == 2


def test_two_runs_side_by_side(runs, chromium, capsys):
    a, b = runs["blade"], runs["rho1"]
    out_page = os.path.join(os.path.dirname(a), "compare", "index.html")
    code, out, err = _show([a, b, "--out", out_page, "--no-progress"], capsys)
    assert code == 0, err
    assert err == ""  # --no-progress: nothing but the summary line
    sa, sb = _shard_rows(os.path.join(a, "selected")), _shard_rows(os.path.join(b, "selected"))
    assert [np.asarray(x["tokens"]).tolist() for x in sa] == [np.asarray(x["tokens"]).tolist() for x in sb]
    ma = [np.asarray(x["loss_mask"]).astype(bool)[1:] for x in sa]
    mb = [np.asarray(x["loss_mask"]).astype(bool)[1:] for x in sb]
    # the overall overlap leaves out the warm-up steps (W = 2: both keep every token, no Δ)
    scored = [bool(np.isfinite(np.asarray(x["score"], dtype=np.float32)[1:]).any()) for x in sa]
    assert scored.count(False) == 2 * 8
    inter = sum(int((x & y).sum()) for x, y, s in zip(ma, mb, scored, strict=True) if s)
    union = sum(int((x | y).sum()) for x, y, s in zip(ma, mb, scored, strict=True) if s)
    assert f"vs rho1: Jaccard {inter / union:.3f} over 12 scored steps" in out

    page = chromium(out_page)
    assert page.errors == []
    facts = json.loads(page.js("() => document.getElementById('facts').textContent"))
    assert facts["jaccard"] == pytest.approx(inter / union, abs=1e-12)
    assert facts["compared_steps"] == 14 and facts["scored_steps"] == 12
    assert facts["paired_rows"] == len(sa) and facts["unpaired_rows"] == 0
    pairs = page.js("() => [...document.querySelectorAll('.tokenview-pairs .row')].map(r => [+r.dataset.row, "
                    "+r.dataset.differ, r.querySelectorAll('.toks .k.a').length, r.querySelectorAll('.toks .d.b').length])")
    differ = [int((x ^ y).sum()) for x, y in zip(ma, mb, strict=True)]
    assert 1 <= len(pairs) <= 8
    assert [d for _, d, _, _ in pairs] == sorted(differ, reverse=True)[:len(pairs)]  # the most disagreeing rows
    for row, d, a_only, b_only in pairs:  # each: kept by A only + kept by B only (positions shown: all 128)
        assert d == differ[row] == a_only + b_only
    assert page.js("() => document.querySelectorAll('#chart-jaccard path.curve').length") >= 2


def test_a_run_in_a_bucket(runs, s3, capsys):
    """The run's directory uploaded to the bucket, the cache empty: the page is made from the bucket's objects and
    uploaded beside them; its token view is the local page's."""
    from curation.io import objects, storage

    run = runs["blade"]
    url = s3.url("runs/blade")
    local = storage.local_path(url)
    shutil.copytree(run, local, ignore=shutil.ignore_patterns("checkpoints", "selection", ".lock"))
    storage.push(local)
    shutil.rmtree(s3.cache)  # nothing cached: every file read comes from the bucket
    code, out, err = _show([url, "--no-progress"], capsys)
    assert code == 0, err
    assert f"page {url}/selection/index.html (" in out  # the page named by its URL, not the cache path
    assert objects.head_object(f"{url}/selection/index.html") is not None
    code, _, err = _show([run, "--no-progress"], capsys)
    assert code == 0, err
    with open(os.path.join(local, "selection", "index.html"), encoding="utf-8") as f:
        remote = f.read()
    with open(os.path.join(run, "selection", "index.html"), encoding="utf-8") as f:
        here = f.read()
    view = re.compile(r'<div class="tokenview".*?</div></div></div>', re.S)
    assert view.search(remote).group(0) == view.search(here).group(0)


def _tokenizer(run: str) -> str:
    import yaml

    with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)["data"]["tokenizer"]


def test_other_jobs_runs_are_recognised_and_bad_input_is_one_line(runs, tmp_path, capsys):
    """A replay shows the shards it trained on; a path with no run, or a run with no shards yet, is one line."""
    import yaml

    from curation.inspector.run import open_run

    run = runs["blade"]
    replay = tmp_path / "replay"
    replay.mkdir()
    (replay / "config.yaml").write_text(yaml.safe_dump({"selected": os.path.join(run, "selected"),
                                                        "tokenizer": _tokenizer(run)}))
    r = open_run(str(replay))
    assert r.job == "replay" and r.selected == os.path.join(run, "selected") and r.tokenizer == _tokenizer(run)
    curate = tmp_path / "curate"
    shutil.copytree(os.path.join(run, "selected"), curate / "selected")
    (curate / "config.yaml").write_text(yaml.safe_dump({"candidates": "x", "proxy_weights": None}))
    r = open_run(str(curate))
    assert r.job == "curate" and r.tokenizer is not None  # found beside the candidates the shards name
    assert not r.tokenizer_note
    code, _, err = _show([str(tmp_path / "nothing"), "--no-progress"], capsys)
    assert code == 1 and err == (f"error: {tmp_path / 'nothing'}: no run here (no config.yaml: give the output "
                                 "directory of jobs/train.py, jobs/curate_and_train.py, jobs/curate.py or "
                                 "jobs/replay.py)\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": None}}))
    code, _, err = _show([str(empty), "--no-progress"], capsys)
    assert code == 1 and err.startswith(f"error: {empty}: no selected-token shards") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        load_job("show_selection", "_t").main([run, "--max-tokens", "0"])
