"""Prepare's tokens/s against the raw tokenizer's on the same texts, with 1 worker and with all workers:
``jobs/bench_prepare.py``.

The input is one ``.jsonl`` of ``{"text": ...}`` records: ``--input``, or ``--mb`` megabytes of the real text of
``../shared/data`` (web, papers, textbooks, speeches, math, fiction, Wikipedia...; shuffled, repeated to size)
written to a temporary file. In one run, on the same texts:

* **raw**: ``Tokenizer.encode_batch`` in batches of 256 on the texts already in memory, with all cores (the
  tokenizer's own threads), and on one core (``RAYON_NUM_THREADS=1``, a separate process);
* **prepare, in this process** (``workers: 1``: read, tokenize, pack, write the shards and manifests);
* **prepare on Ray** with each worker count of ``--workers``, the local Ray instance and its worker processes
  started (and warmed up by a small prepare) before the clock starts: the throughput of a long run, whose
  start-up is paid once; and **cold**: ``jobs/prepare.py`` with the most workers, as a user runs it (Python and
  Ray start-up included).

For each: tokens/s (wall clock) and tokens per CPU-second (the CPU time of this process and of every process it
started, Ray's included: robust to other load on a shared machine, which the wall clock is not; the cold run:
wall clock only). Ratios: prepare ÷
raw (goal ≥ 0.8 with all workers) and the scaling efficiency T(N) ÷ (N · T(1)) of the Ray runs (goal ≥ 0.9 per
added worker where there are free cores).

``--huge-doc MB [MB ...]``: instead, the peak resident memory of ``jobs/prepare.py`` (a fresh process, as a user
runs it: its own, by ``getrusage``, and the largest of the processes it started, Ray's workers, sampled) preparing a
``.jsonl`` whose one document is MB megabytes on a single line (words of a small vocabulary, a 300-token BPE,
L = 512), once in this process (``workers: 1``) and once as the job chooses (Ray workers when the file makes
several units). Goal: under 1 GB at 20 MB, and flat as the document grows (a line over 4 MB is streamed, never held whole:
``curation/ingest/jsonstream.py``).

``--two-nodes N``: instead, prepare's scaling with its tasks on two Ray nodes started on this machine
(:class:`bench.two_nodes.LocalNodes`, each declaring ``N`` CPUs and ``N/2`` of a role resource ``prep``), the worker
processes warmed up first: ``N`` tasks pinned to the head (``resources: {node_a: 1}``), then ``N`` tasks asking for
``{prep: 1}`` (``N/2`` run on each node); each twice, alternately (the better round reported). For each: tokens/s, tokens per CPU-second (both nodes' processes are this
one's children) and tokens/s per task. Goal: the same tokens/s per task on two nodes as on one (the tasks share
nothing but the driver, which hands out units and writes the manifests). Both nodes are on this machine and share its
cores: this measures what spreading the tasks over nodes costs, not more hardware; the output directory is a local
one both nodes see (the object store's transfers are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
import yaml
from tokenizers import Tokenizer

from bench.two_nodes import LocalNodes
from curation.engine.ray_backend.prepare_pool import ray_unit_pool
from curation.engine.ray_backend.session import ray_session
from curation.ingest.prepare import PoolFactory, prepare
from curation.ingest.tokenizer import train_bpe_tokenizer
from schemas.config import PrepareConfig, RayConfig, SourceConfig, TokenizerConfig

__all__ = ["SHARED", "build_input", "huge_documents", "run"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")

#: (file under ../shared/data, how a record becomes text) of the real sources the input is built from.
_JSONL = [("c4_sample/c4_sample.jsonl", "{text}"), ("arxiv_sample/arxiv.jsonl", "{text}"),
          ("textbook_hott/hott_tex.jsonl", "{text}"), ("textbook_openintro_stats/openintro_stats_tex.jsonl", "{text}"),
          ("us_presidential_speeches/inaugural.jsonl", "{text}"), ("us_presidential_speeches/state_union.jsonl", "{text}"),
          ("gsm8k/train.jsonl", "{question}\n{answer}"), ("math_hendrycks/test.jsonl", "{problem}\n{solution}"),
          ("lambada/lambada_openai.jsonl", "{context}{continuation}"), ("pubmedqa/pubmed_qa_labeled.jsonl", "{context}"),
          ("boolq/boolq.jsonl", "{query}")]
_TXT = ["wikitext2/valid.txt", "wikitext2/test.txt", "tinyshakespeare/input.txt"]


def build_input(path: str, mb: float) -> int:
    """Write ``mb`` MB of ``{"text": ...}`` lines of the real text of ../shared/data (shuffled, repeated)."""
    texts: list[str] = []
    for rel, template in _JSONL:
        with open(os.path.join(SHARED, rel), encoding="utf-8") as f:
            texts += [template.format_map(json.loads(line)) for line in f if line.strip()]
    for rel in _TXT:
        with open(os.path.join(SHARED, rel), encoding="utf-8") as f:
            texts += [t.strip("\n") for t in f.read().split("\n\n") if t.strip()]
    rng, size, rounds = random.Random(0), 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while size < mb * 1e6:
            rng.shuffle(texts)
            for t in texts:
                line = json.dumps({"text": t, "round": rounds}) + "\n"
                out.write(line)
                size += len(line.encode())
                if size >= mb * 1e6:
                    break
            rounds += 1
    return size


def _cpu() -> float:
    """CPU seconds of this process and of every process it started (alive or waited for)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:4])  # user, system, children_user, children_system (ended children)
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _raw(path: str, tokenizer: str) -> dict:
    tok = Tokenizer.from_file(tokenizer)
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(texts), 256):
        n += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"tokens": n, "seconds": wall, "cpu_seconds": cpu, "tokens_per_s": n / wall, "tokens_per_cpu_s": n / cpu}


def _raw_one_core(args: argparse.Namespace, path: str) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "bench_prepare.py"), "--raw-only", "--input", path, "--tokenizer", args.tokenizer],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def _config(args: argparse.Namespace, path: str, out: str, workers: int | None) -> PrepareConfig:
    extra = {"unit_bytes": int(args.unit_mb * 2**20)} if args.unit_mb else {}
    return PrepareConfig(sources=[SourceConfig(name="bench", paths=[path])], tokenizer=TokenizerConfig(path=args.tokenizer),
                         output_dir=out, seq_len=args.seq_len, progress=False, workers=workers, **extra)


def _prepare(cfg: PrepareConfig, pool: PoolFactory | None) -> dict:
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    cpu = _cpu()
    wall = time.perf_counter()
    res = prepare(cfg, pool=pool)
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    n = res.tokens_processed
    return {"workers": res.workers, "tokens": n, "seconds": wall, "cpu_seconds": cpu, "tokens_per_s": n / wall,
            "tokens_per_cpu_s": n / cpu, "unit_cpu_seconds": res.unit_cpu_seconds}


def _cold(args: argparse.Namespace, path: str, tmp: str, workers: int) -> dict:
    cfg = _config(args, path, os.path.join(tmp, "cold"), workers)
    conf = os.path.join(tmp, "cold.yaml")
    with open(conf, "w", encoding="utf-8") as f:
        json.dump(cfg.model_dump(mode="json"), f)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    wall = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "prepare.py"), "--config", conf],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - wall
    if done.returncode != 0:
        raise RuntimeError(f"jobs/prepare.py failed: {done.stderr[-2000:]}")
    n = int(done.stdout.split("tokenized ")[1].split()[0])
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    # (no CPU time: the job's Ray processes are not its waited-for children, so they cannot be counted here)
    return {"workers": workers, "tokens": n, "seconds": wall, "tokens_per_s": n / wall}


def run(args: argparse.Namespace) -> int:
    """The benchmark of the module docstring, printed (``args.json``: also one JSON object); the exit status."""
    if args.raw_only:
        print(json.dumps(_raw(args.input, args.tokenizer)))
        return 0
    if args.huge_doc:
        report = huge_documents(args.huge_doc)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.two_nodes:
        return _two_nodes(args)
    counts = args.workers or sorted({1, os.cpu_count() or 1})
    tmp = tempfile.mkdtemp(prefix="bench_prepare-")
    try:
        path = _input(args, tmp)
        mb = os.path.getsize(path) / 1e6
        raw, raw1 = _raw(path, args.tokenizer), _raw_one_core(args, path)
        local = _prepare(_config(args, path, os.path.join(tmp, "local"), 1), None)
        runs = []
        with ray_session(RayConfig().address, need_cpus=max(counts)):
            for n in counts:
                def pool(workers, units, needs, n=n):  # noqa: ANN001, ANN202 - the prepare pool factory, n workers
                    return ray_unit_pool(RayConfig(), n, units, needs)

                warm = _warm_up(args, path, tmp, pool, n)
                # workers: null (1 would run in this process); the pool makes it n
                run = _prepare(_config(args, path, os.path.join(tmp, f"ray{n}"), None), pool)
                run["warm_up_seconds"] = warm
                runs.append(run)
        cold = None if args.no_cold else _cold(args, path, tmp, max(counts))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = _report(args, mb, raw, raw1, local, runs, cold)
    if args.json:
        print(json.dumps(report))
    return 0


def _input(args: argparse.Namespace, tmp: str) -> str:
    """``--input``, or a synthetic JSONL corpus of ``--mb`` MB built under ``tmp``."""
    if args.input is not None:
        return args.input
    path = os.path.join(tmp, "input.jsonl")
    build_input(path, args.mb)
    return path


def _two_nodes(args: argparse.Namespace) -> int:
    """``--two-nodes N``: :func:`_run_two_nodes` on the input."""
    tmp = tempfile.mkdtemp(prefix="bench_prepare-")
    try:
        path = _input(args, tmp)
        runs = _run_two_nodes(args, path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"input_mb": os.path.getsize(path) / 1e6 if args.input else args.mb, "seq_len": args.seq_len,
                          "cpus": os.cpu_count(), "two_nodes": runs}))
    return 0


def _run_two_nodes(args: argparse.Namespace, path: str, tmp: str) -> dict:
    """``--two-nodes N`` on the input ``path`` (the module docstring), printed; its numbers."""
    n = args.two_nodes
    if n < 2 or n % 2:
        raise ValueError(f"--two-nodes {n}: give an even number of tasks (half of them on each node)")
    nodes = LocalNodes({"node_a": {"prep": n // 2}, "node_b": {"prep": n // 2}}, cpus=n)
    places = {"one node": {"node_a": 1}, "two nodes": {"prep": 1}}
    runs: dict[str, dict] = {}
    try:
        nodes.start()
        cluster = RayConfig(address=nodes.address)
        with ray_session(cluster.address, need_cpus=n):
            pools = {}
            for name, resources in places.items():
                def pool(workers, units, needs, resources=resources):  # noqa: ANN001, ANN202 - the pool factory
                    return ray_unit_pool(cluster, n, units, needs, resources=resources)

                pools[name] = pool
                warm = _warm_up(args, path, tmp, pool, n)
                runs[name] = {"warm_up_seconds": warm, "tasks": n, "resources": resources, "rounds": []}
            for _ in range(2):  # alternately, so that a change of the machine's other load weighs on both alike
                for name in places:
                    out = os.path.join(tmp, name.replace(" ", "-"))
                    runs[name]["rounds"].append(_prepare(_config(args, path, out, None), pools[name]))
    finally:
        nodes.stop()
    for r in runs.values():  # the better round of each (the one less disturbed by other load)
        r.update(max(r["rounds"], key=lambda x: x["tokens_per_s"]))
        r["tokens_per_s_per_task"] = r["tokens_per_s"] / n
    one, two = runs["one node"], runs["two nodes"]
    two["per_task_vs_one_node"] = two["tokens_per_s_per_task"] / one["tokens_per_s_per_task"]
    two["per_cpu_s_vs_one_node"] = two["tokens_per_cpu_s"] / one["tokens_per_cpu_s"]
    print(f"prepare with {n} tasks on two local Ray nodes ({os.cpu_count()} CPUs on this machine):")
    for name, r in runs.items():
        rounds = ", ".join(f"{x['seconds']:.1f}" for x in r["rounds"])
        print(f"  {name + ':':10s} {r['tokens_per_s']:>10,.0f} tokens/s  {r['tokens_per_s_per_task']:>10,.0f} per task"
              f"  {r['tokens_per_cpu_s']:>10,.0f} tokens/CPU-s  ({r['tokens']:,} tokens, {r['seconds']:.1f} s; the "
              f"better of {len(r['rounds'])}: {rounds} s)")
    print(f"  two nodes ÷ one node: {two['per_task_vs_one_node']:.2f} per task, "
          f"{two['per_cpu_s_vs_one_node']:.2f} per CPU-second")
    return runs


def huge_documents(sizes: list[float]) -> dict:
    """Peak RSS of ``jobs/prepare.py`` on a one-document input of each size (see the module docstring)."""

    words = np.array("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split())
    rng = np.random.default_rng(7)
    tmp = tempfile.mkdtemp(prefix="bench_prepare-huge-")
    out: dict = {"runs": []}
    try:
        tok = train_bpe_tokenizer((" ".join(rng.choice(words, 40)) for _ in range(200)), vocab_size=300,
                                  save_to=os.path.join(tmp, "tok", "tokenizer.json"))
        for mb in sizes:
            path = os.path.join(tmp, f"doc{mb:g}.jsonl")
            with open(path, "w", encoding="utf-8") as f:  # written in pieces: this process never holds it
                f.write('{"text": "a small one"}\n{"text": "')
                left = int(mb * 1e6)
                while left > 0:
                    chunk = " ".join(rng.choice(words, min(1 << 20, max(1, left // 6)))) + " "
                    f.write(chunk[:left])
                    left -= len(chunk)
                f.write('end"}\n')
            for workers in (1, None):
                cfg = PrepareConfig(sources=[SourceConfig(name="big", paths=[path])], validation=[],
                                    tokenizer=TokenizerConfig(path=tok.path), output_dir=os.path.join(tmp, "out"),
                                    seq_len=512, sequences_per_part=1024, progress=False, workers=workers)
                conf = os.path.join(tmp, "job.yaml")
                with open(conf, "w", encoding="utf-8") as f:
                    yaml.safe_dump(cfg.model_dump(mode="json"), f)
                probe = ("import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
                         "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nfinally:\n"
                         "    print(f'PEAK {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)")
                t = time.perf_counter()
                proc = subprocess.Popen([sys.executable, "-c", probe, os.path.join(REPO, "jobs", "prepare.py"),
                                         "--config", conf], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
                others = _largest_descendant(proc)
                _, err = proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"jobs/prepare.py failed: {err[-2000:]}")
                me = int(err.split("PEAK ")[1].split()[0]) / 1024
                run = {"document_mb": os.path.getsize(path) / 1e6, "workers": workers or "auto",
                       "peak_rss_mb": round(me), "largest_other_process_mb": round(others),
                       "seconds": round(time.perf_counter() - t, 1)}
                print(f"{run['document_mb']:6.1f} MB document, workers {run['workers']}: peak RSS of jobs/prepare.py "
                      f"{me:.0f} MB; of its largest other process (a Ray worker...): {others:.0f} MB; "
                      f"{run['seconds']:.0f} s", flush=True)
                out["runs"].append(run)
                shutil.rmtree(cfg.output_dir, ignore_errors=True)
            os.unlink(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _largest_descendant(proc: subprocess.Popen) -> float:
    """Until ``proc`` ends: the largest RSS (MB) seen of any process it started (Ray's are not its waited-for
    children, so ``getrusage`` misses them), sampled every 0.1 s."""
    top = 0.0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in root.children(recursive=True):
                try:
                    top = max(top, child.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        time.sleep(0.1)
    return top


def _warm_up(args: argparse.Namespace, path: str, tmp: str, pool, n: int) -> float:  # noqa: ANN001
    """Start and warm ``n`` worker processes (imports, tokenizer) with a small prepare of the input's start."""
    small = os.path.join(tmp, "warm.jsonl")
    with open(path, "rb") as f, open(small, "wb") as out:
        out.write(b"".join(f.readline() for _ in range(2000 * n)))
    t = time.perf_counter()
    cfg = _config(args, small, os.path.join(tmp, "warm"), None)
    _prepare(cfg.model_copy(update={"unit_bytes": max(1, os.path.getsize(small) // n)}), pool)
    return time.perf_counter() - t


def _report(args, mb, raw, raw1, local, runs, cold) -> dict:  # noqa: ANN001
    base = runs[0]
    print(f"prepare vs the raw tokenizer: {mb:.1f} MB of jsonl, {raw['tokens']:,} tokens, {os.path.basename(args.tokenizer)},"
          f" seq_len {args.seq_len}, {os.cpu_count()} CPUs")
    for name, r in (("raw encode_batch(256), all cores:", raw), ("raw encode_batch(256), one core:", raw1)):
        print(f"  {name:34s} {r['tokens_per_s']:>10,.0f} tokens/s  {r['tokens_per_cpu_s']:>10,.0f} tokens/CPU-s")

    def line(name: str, r: dict) -> None:
        r["vs_raw"] = r["tokens_per_s"] / raw["tokens_per_s"]
        cpu = ""
        if "tokens_per_cpu_s" in r:
            r["vs_raw_cpu"] = r["tokens_per_cpu_s"] / raw["tokens_per_cpu_s"]
            cpu = f"{r['tokens_per_cpu_s']:>10,.0f} tokens/CPU-s"
        print(f"  {name:34s} {r['tokens_per_s']:>10,.0f} tokens/s  {cpu:>23s}  ÷ raw {r['vs_raw']:.2f}"
              + (f" (CPU {r['vs_raw_cpu']:.2f})" if "vs_raw_cpu" in r else "")
              + (f"  scaling {r['efficiency']:.2f} (CPU {r['efficiency_cpu']:.2f})" if "efficiency" in r else ""))

    line("prepare in-process (workers 1):", local)
    for r in runs:
        r["efficiency"] = r["tokens_per_s"] / (r["workers"] / base["workers"] * base["tokens_per_s"])
        r["efficiency_cpu"] = r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        line(f"prepare on Ray, {r['workers']} worker(s), warm:", r)
    if cold is not None:
        line(f"jobs/prepare.py, {cold['workers']} workers, cold:", cold)
    return {"input_mb": mb, "tokenizer": args.tokenizer, "seq_len": args.seq_len, "cpus": os.cpu_count(),
            "raw": raw, "raw_one_core": raw1, "in_process": local, "ray": runs, "cold": cold}

