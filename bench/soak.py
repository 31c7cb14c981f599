"""The chaos soak of the main job (``jobs/soak.py``): ``jobs/curate_and_train.py`` run while a seeded schedule kills
its scoring workers, its refresh actor and its trainer, against an uninterrupted run of the same config.

1. The uninterrupted run (``<out>/uninterrupted``) and the chaos run (``<out>/chaos``): the same config (the demo
   corpus, prepared once under ``<out>/data``; the demo's tiny Llama; exact mode; 2 scoring workers).
2. The schedule (``random.Random(seed)``): ``trainer_kills`` trainer deaths (SIGTERM or SIGKILL, half each) and
   ``actor_kills`` kills of a scoring worker or of the refresh actor (SIGKILL or SIGTERM), each at a step drawn
   from the run's steps. A step is the trainer's, read from its metrics log. After a trainer death the whole
   session (the driver and its local Ray instance) is ended and the job is rerun; an actor is restarted by Ray.
3. Checks: the chaos run's final proxy and reference, its selected-token rows (sequences, masks, scores, steps,
   episodes, sources) and its workers' reference scores equal the uninterrupted run's byte for byte; every work unit
   of the plan is recorded exactly once in the ledger (``scored/manifest.json``); a SIGTERM'd trainer stops cleanly:
   exit 143, no process of its session left running, no ``final/`` or ``summary.json`` (each trainer death's event
   records those, the job's last stderr line and the checkpoints); the resident memory and open file descriptors of
   the driver and of the scoring workers, sampled every second once training runs (``<out>/samples.jsonl``), grow by
   at most ``max_growth`` between the first and the last quarter of the last attempt (the longest stretch without a
   trainer death; each process against itself, since a rerun starts new processes; a worker restarted within it is
   left out).
4. Figures: the kills sent by target and signal (``kills``), and the work they made the run redo (``redone``): trainer
   steps trained twice (the metrics log), work units whose parts an ended session left unfinished, and units redone
   by restarted workers (the engine's count).

The kills go to processes of the job's own session only (found under ``/proc``: Linux).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import yaml

from bench.sessions import command, session_pids
from curation.io.shards import read_column
from schemas.engine_config import CurateAndTrainConfig
from schemas.manifest import Manifest
from schemas.train_config import demo_model_config

__all__ = ["SoakSettings", "soak", "soak_config"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/soak.py → the checkout
JOB = os.path.join(REPO, "jobs", "curate_and_train.py")
ROLES = {"worker": "_WorkerActor", "refresh": "_RefreshActor"}


@dataclass
class SoakSettings:
    """What a soak runs: ``steps`` trainer steps, ``trainer_kills`` trainer deaths and ``actor_kills`` kills of a
    scoring worker or the refresh actor, drawn from ``seed``; outputs under ``out``."""

    out: str
    steps: int = 2000
    seed: int = 0
    trainer_kills: int = 3
    actor_kills: int = 6
    max_growth: float = 0.10
    timeout_s: float = 1800.0
    events: list[dict[str, Any]] = field(default_factory=list)


def soak_config(out: str, name: str, steps: int) -> dict[str, Any]:
    """The job config of a soak run (JSON form): the demo corpus under ``out/data``, a tiny Llama, τ = 25."""
    cfg = CurateAndTrainConfig.demo_default(out).model_dump(mode="json")
    t = cfg["train"]
    t.update(output_dir=os.path.join(out, name), max_steps=steps, batch_size=8, progress_bar=False, plots=False,
             model=demo_model_config(512, hidden=32, layers=1).model_dump(mode="json"))
    t["selection"].update(warmup_steps=5, tau=25, refresh_steps=2, refresh_batch_size=2)
    t["eval"].update(interval=max(steps // 4, 1), max_batches=1)
    t["checkpoint"].update(interval=10, keep=2)
    cfg["prepare"]["tokenizer"]["vocab_size"] = 512
    cfg["workers"].update(count=2, range_steps=5)
    cfg["engine"].update(lookahead=10)
    return cfg


def _schedule(s: SoakSettings) -> list[dict[str, Any]]:
    rng = random.Random(s.seed)
    lo, hi = 6, max(7, s.steps * 3 // 4)  # the last quarter runs without a trainer death (the growth figures)
    ev = [{"step": rng.randrange(lo, hi), "target": "trainer", "signal": "SIGTERM" if i % 2 == 0 else "SIGKILL"}
          for i in range(s.trainer_kills)]
    ev += [{"step": rng.randrange(lo, max(lo + 1, s.steps - 5)), "target": rng.choice(sorted(ROLES)),
            "signal": rng.choice(["SIGKILL", "SIGTERM"])} for _ in range(s.actor_kills)]
    return sorted(ev, key=lambda e: (e["step"], e["target"] != "trainer"))


# ------------------------------------------------------------------------------------------------
# processes of a job's session
# ------------------------------------------------------------------------------------------------
def _usage(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open file descriptors) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", encoding="utf-8") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None


def _killsession_pids(sid: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _StepLog:
    """The trainer's last finished step, read incrementally from ``logs/metrics.jsonl``; what this attempt logged:
    the steps it trained and the engine's count of units redone by restarted workers (logged every 10 steps)."""

    def __init__(self, output_dir: str) -> None:
        self.path, self.pos, self.step = os.path.join(output_dir, "logs", "metrics.jsonl"), 0, 0
        self.trained = self.units_redone = 0
        self.read()  # what earlier attempts logged
        self.fresh = False  # whether this attempt has trained a step yet
        self.trained = self.units_redone = 0  # (this attempt's)

    def read(self) -> int:
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.pos)
                for line in f:
                    if not line.endswith("\n"):
                        break
                    self.pos += len(line.encode())
                    rec = json.loads(line)
                    if "loss/train/total" in rec:
                        self.step, self.fresh = int(rec["step"]) + 1, True
                        self.trained += 1
                    if "engine/redone" in rec:
                        self.units_redone = int(rec["engine/redone"])
        return self.step


def _unfinished_parts(output_dir: str) -> int:
    """Parts of the workers left unfinished (``.tmp``) or unrecorded in ``scored/`` by an ended session: the units
    the rerun redoes (its ledger removes these parts first)."""
    out = os.path.join(output_dir, "scored")
    manifest = Manifest.load_if_exists(out)
    recorded = {r.name for r in manifest.shards if r.complete} if manifest is not None else set()
    return sum(part.endswith(".tmp") or f"{entry}/{part}" not in recorded
               for entry in (os.listdir(out) if os.path.isdir(out) else []) if entry.startswith("worker-")
               for part in os.listdir(os.path.join(out, entry)))


# ------------------------------------------------------------------------------------------------
# the runs
# ------------------------------------------------------------------------------------------------
def _start(config: str, stderr) -> subprocess.Popen:  # noqa: ANN001 - an open file
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, JOB, "--config", config], stdout=subprocess.DEVNULL,
                            stderr=stderr, env=env, start_new_session=True)


def _running(sid: int) -> list[int]:
    """The processes of session ``sid`` but its leader still running (zombies, ended but not yet reaped, aside)."""
    return [pid for pid in session_pids(sid, running=True) if pid != sid]


def _after_death(sid: int, output_dir: str, stderr: str) -> dict[str, Any]:
    """What a trainer death left, read as soon as the driver ended (before the soak ends its session): the
    session's processes still running (none after a SIGTERM: the job shuts its Ray instance down), the job's last
    line on stderr (a SIGTERM's names the step and the checkpoint to resume from), the checkpoints there are, and
    whether the run wrote ``final/`` or ``summary.json`` (it must not: it did not finish)."""
    with open(stderr, encoding="utf-8", errors="replace") as f:
        lines = f.read().strip().splitlines()
    ckpts = os.path.join(output_dir, "checkpoints")
    return {"left": len(_running(sid)), "last_line": lines[-1] if lines else "", "stderr": stderr,
            "checkpoints": sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else [],
            "finished": any(os.path.exists(os.path.join(output_dir, x)) for x in ("final", "summary.json"))}


@dataclass
class _Record:
    """What the chaos run's attempts leave: resource samples, the kills sent, one line per attempt."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)


def _attempt(config: str, output_dir: str, events: list[dict[str, Any]], deadline: float, rec: _Record,
             attempt: int) -> bool:
    """One run of the job until it ends or a trainer event ends it; returns whether it finished (exit 0). The job's
    stderr goes to ``<output_dir>.attempt-<attempt>.stderr`` (a file: a pipe nobody reads would fill and block it)."""
    stderr = f"{output_dir}.attempt-{attempt}.stderr"
    with open(stderr, "w", encoding="utf-8") as err:
        proc = _start(config, err)
    steps, last_sample = _StepLog(output_dir), 0.0
    samples, log = rec.samples, rec.events
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the soak ran past its time limit (attempt {attempt})")
            step = steps.read()
            now = time.monotonic()
            if now - last_sample >= 1.0 and steps.fresh:  # once training runs (not the start-up's imports)
                last_sample = now
                for pid in session_pids(proc.pid):
                    role = "driver" if pid == proc.pid else next(
                        (r for r, tag in ROLES.items() if tag in " ".join(command(pid))), None)
                    use = _usage(pid) if role in ("driver", "worker") else None
                    if use is not None:
                        samples.append({"attempt": attempt, "t": now, "step": step, "role": role, "pid": pid,
                                        "rss": use[0], "fds": use[1]})
            while steps.fresh and events and events[0]["step"] <= step:
                ev = events.pop(0)
                sig = getattr(signal, ev["signal"])
                if ev["target"] == "trainer":
                    os.kill(proc.pid, sig)
                    try:
                        proc.wait(timeout=120 if sig == signal.SIGTERM else 10)
                    except subprocess.TimeoutExpired:
                        pass
                    log.append({**ev, "at_step": step, "attempt": attempt, "exit": proc.poll(),
                                **_after_death(proc.pid, output_dir, stderr)})
                    return False
                pids = [p for p in session_pids(proc.pid) if ROLES[ev["target"]] in " ".join(command(p))]
                if pids:
                    os.kill(random.Random(step).choice(pids), sig)
                log.append({**ev, "at_step": step, "attempt": attempt, "killed": bool(pids)})
            time.sleep(0.2)
        if proc.returncode != 0:
            with open(stderr, encoding="utf-8", errors="replace") as f:
                raise RuntimeError(f"the job failed (exit {proc.returncode}; {stderr}): {f.read()[-3000:]}")
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
        _killsession_pids(proc.pid)  # its local Ray instance, whatever is left of it
        proc.wait()
        steps.read()
        rec.attempts.append({"attempt": attempt, "exit": proc.returncode, "steps_trained": steps.trained,
                             "units_redone_logged": steps.units_redone,
                             "parts_left_unfinished": _unfinished_parts(output_dir)})


def _growth(samples: list[dict[str, Any]], role: str) -> dict[str, Any]:
    """Growth of RSS and FDs of ``role``'s processes between the first and the last quarter (by time) of the last
    attempt, each process against itself; the largest, with that process's figures. Only processes alive in both
    quarters count (a worker restarted by a kill starts over: its start-up is not a leak)."""
    last = [s for s in samples if s["attempt"] == max((x["attempt"] for x in samples), default=0)]
    out: dict[str, Any] = {"rss": None, "fds": None, "processes": 0, "excluded": 0}
    if not last:
        return out
    t0, t1 = min(s["t"] for s in last), max(s["t"] for s in last)
    q = (t1 - t0) / 4
    for pid in sorted({s["pid"] for s in last if s["role"] == role}):
        xs = [s for s in last if s["pid"] == pid]
        first, end = [s for s in xs if s["t"] <= t0 + q], [s for s in xs if s["t"] >= t1 - q]
        if not first or not end:
            out["excluded"] += 1
            continue
        out["processes"] += 1
        for key in ("rss", "fds"):
            a, b = float(np.mean([s[key] for s in first])), float(np.mean([s[key] for s in end]))
            g = b / a - 1.0
            if out[key] is None or g > out[key]:
                out[key] = g
                out[f"{key}_first"], out[f"{key}_last"], out[f"{key}_samples"] = a, b, (len(first), len(end))
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _same_columns(a: str, b: str, columns: tuple[str, ...]) -> bool:
    for col in columns:
        x, y = read_column(a, col), read_column(b, col)
        if len(x) != len(y) or not all(u == v if isinstance(u, str) else np.array_equal(u, v, equal_nan=True)
                                       for u, v in zip(x, y, strict=True)):
            return False
    return True


def soak(s: SoakSettings) -> dict[str, Any]:
    """Run the soak (module docstring) and return its figures; ``ok`` says whether every check passed."""
    os.makedirs(s.out, exist_ok=True)
    start, deadline = time.monotonic(), time.monotonic() + s.timeout_s
    paths = {}
    for name in ("uninterrupted", "chaos"):
        paths[name] = os.path.join(s.out, f"{name}.yaml")
        with open(paths[name], "w", encoding="utf-8") as f:
            yaml.safe_dump(soak_config(s.out, name, s.steps), f)
    events, rec = s.events or _schedule(s), _Record()
    samples, log = rec.samples, rec.events
    full_dir, chaos_dir = os.path.join(s.out, "uninterrupted"), os.path.join(s.out, "chaos")
    t0 = time.monotonic()
    if not _attempt(paths["uninterrupted"], full_dir, [], deadline, _Record(), 0):
        raise RuntimeError("the uninterrupted run did not finish")
    uninterrupted_s = time.monotonic() - t0
    pending, attempts = list(events), 0
    while True:
        attempts += 1
        if _attempt(paths["chaos"], chaos_dir, pending, deadline, rec, attempts):
            break
    full, chaos = Manifest.load(os.path.join(full_dir, "scored")), Manifest.load(os.path.join(chaos_dir, "scored"))
    units = [r.state["unit"] for r in chaos.shards]
    checks = {
        "final_weights_equal": _read(os.path.join(full_dir, "final", "model.safetensors"))
        == _read(os.path.join(chaos_dir, "final", "model.safetensors")),
        "final_reference_equal": _read(os.path.join(full_dir, "final", "reference.safetensors"))
        == _read(os.path.join(chaos_dir, "final", "reference.safetensors")),
        "masks_equal": _same_columns(os.path.join(full_dir, "selected"), os.path.join(chaos_dir, "selected"),
                                     ("step", "tokens", "loss_mask", "score", "episode", "source")),
        "scores_equal": _same_columns(os.path.join(full_dir, "scored"), os.path.join(chaos_dir, "scored"),
                                      ("tokens", "ref_loss", "episode")),
        "units_exactly_once": len(units) == len(set(units)) and sorted(units) == sorted(
            r.state["unit"] for r in full.shards) and chaos.complete,
    }
    with open(os.path.join(s.out, "samples.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in samples)
    checks["sigterm_stops_clean"] = all(e["exit"] == 143 and not e["left"] and not e["finished"]
                                        for e in log if e["target"] == "trainer" and e["signal"] == "SIGTERM")
    growth = {role: _growth(samples, role) for role in ("driver", "worker")}
    checks["growth_within_limit"] = all(
        g[k] is not None and g[k] <= s.max_growth for g in growth.values() for k in ("rss", "fds"))
    return {"ok": all(checks.values()), "checks": checks, "steps": s.steps, "seed": s.seed, "attempts": attempts,
            "events": log, "events_not_reached": pending, "kills": _kills(log), "units": len(units),
            "redone": _redone(rec.attempts, s.steps, chaos_dir), "per_attempt": rec.attempts, "growth": growth,
            "max_growth": s.max_growth, "uninterrupted_seconds": uninterrupted_s,
            "seconds": time.monotonic() - start, "out": s.out}


def _kills(log: list[dict[str, Any]]) -> dict[str, int]:
    """The kills sent (and survived, when the run's checks pass), by target and signal."""
    out: dict[str, int] = {}
    for e in log:
        if e["target"] == "trainer" or e["killed"]:
            key = f"{e['target']}_{e['signal']}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _redone(attempts: list[dict[str, Any]], steps: int, output_dir: str) -> dict[str, Any]:
    """What the kills made the chaos run do again: trainer steps (trained in all, from the metrics log, less
    ``steps``), work units of the workers' parts left unfinished by an ended session, and units redone by restarted
    workers (the engine's count: the last attempt's from its summary, the earlier ones' as last logged)."""
    with open(os.path.join(output_dir, "summary.json"), encoding="utf-8") as f:
        last = int(json.load(f)["engine"]["units_redone_after_restart"])
    trained = sum(a["steps_trained"] for a in attempts)
    return {"steps_trained": trained, "steps": trained - steps,
            "units_left_unfinished_by_trainer_deaths": sum(a["parts_left_unfinished"] for a in attempts[:-1]),
            "units_redone_by_restarted_workers": sum(a["units_redone_logged"] for a in attempts[:-1]) + last}
