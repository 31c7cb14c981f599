"""Arms of an earlier report of the same preset (``Setting.recorded``: its ``results.json``), used instead of
training them again, and the checks that decide whether they may be.

A recorded arm (``RECORDED_ARMS``: ``random``, ``rho1``, ``blade``, ``blade-nosync``, and their replays by the
target) stands in for a trained one only when all of these hold:

* the recorded run's preset equals this one in every setting it recorded (the operational ``parallel_runs`` and
  the list of replayed policies aside, :data:`MAY_DIFFER`);
* the arm trains with the same selection setting in that pool as it did there (a choice made again that comes
  out otherwise makes the arm a new one, trained);
* this machine reproduces the recorded floats exactly: every number the benchmark trains again that the record
  also holds is compared bit for bit (:meth:`Checks.compare`): the proxy's base (validation curve, dev loss, the
  six evaluation sets), the paper pool's seed-0 candidates that are the recorded arms' seed-0 runs, each seed's
  ``full`` at the run's length and at the recorded arms' equal-compute steps, the target's base, and the target's
  ``full`` at the target run's length. A check that fails makes every recorded arm trained, from that stage on
  (``bench.quality.experiment``), and the report says which check failed.

Pure data and comparisons (no torch): the record is read once, and its SHA-256 is kept with the results.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from typing import Any

__all__ = ["MAY_DIFFER", "Recorded", "Checks", "blade_keys", "rho1_keys", "same_choice"]

#: settings of the preset that may differ from the recorded run's without changing a recorded arm's training
MAY_DIFFER = ("parallel_runs", "paper_reuse_policies", "reuse_policies", "recorded")
#: the SelectionConfig keys of each family's choice
BLADE_KEYS = ("refresh_steps", "ref_lr", "lam", "refresh_batch_size")
RHO1_KEYS = ("rho1_steps", "ref_lr", "refresh_batch_size")


def blade_keys(sel: dict[str, Any]) -> dict[str, Any]:
    return {k: sel[k] for k in BLADE_KEYS if k in sel}


def rho1_keys(sel: dict[str, Any]) -> dict[str, Any]:
    return {k: sel[k] for k in RHO1_KEYS if k in sel}


def same_choice(family: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two selection settings of a family train alike (only the family's keys count)."""
    keys = blade_keys if family in ("blade", "blade-nosync") else rho1_keys
    return keys(a) == keys(b)


def _plain(x: Any) -> Any:
    """JSON's view of a value (tuples as lists), so a preset compares with its recorded dict."""
    return json.loads(json.dumps(x))


class Recorded:
    """A recorded ``results.json`` and what it supplies."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            raw = f.read()
        self.path, self.sha256 = path, hashlib.sha256(raw).hexdigest()
        self.r: dict[str, Any] = json.loads(raw)
        for key in ("setting", "settings", "bases", "base_eval", "sweep", "equal_compute_steps"):
            if key not in self.r:
                raise ValueError(f"{path}: not a quality benchmark report (no {key!r})")

    def setting_differences(self, s: Any) -> list[str]:
        """The preset's settings that differ from the recorded run's (``MAY_DIFFER`` aside), as ``key: ours vs
        theirs``; a setting the recorded run did not have is not compared (it is new, and its default is what
        the recorded run did)."""
        ours, theirs = _plain(asdict(s)), self.r["setting"]
        return [f"{k}: {ours.get(k)!r} vs {v!r}" for k, v in theirs.items()
                if k not in MAY_DIFFER and ours.get(k) != v]

    def best(self, setting: str) -> dict[str, dict[str, Any]]:
        """The recorded choices of a setting by family: a report that chose per setting (``best``) or one choice
        for both (v7's ``best_refresh``; RHO-1's reference trained with BLADE's η_w and refresh batch)."""
        if "best" in self.r:
            b = self.r["best"][setting]
            return {"blade": blade_keys(b["blade"]), "rho1": rho1_keys(b["rho1"])}
        b = self.r["best_refresh"]
        return {"blade": blade_keys(b), "rho1": {"rho1_steps": b["rho1_steps"], "ref_lr": b["ref_lr"],
                                                 "refresh_batch_size": b["refresh_batch_size"]}}

    def sweep_rows(self, setting: str) -> list[dict[str, Any]]:
        """The candidate rows of a setting's recorded choices (v7's: all made in the first setting)."""
        return [dict(row) for row in self.r["sweep"] if row.get("in_setting", setting) == setting]

    def budgets(self, setting: str) -> dict[str, float]:
        if "sweep_budgets" in self.r:
            return dict(self.r["sweep_budgets"][setting])
        return {"blade": self.r["sweep_budget"], "rho1": self.r["rho1_budget"]}

    def equal_compute_steps(self, setting: str) -> dict[str, int]:
        eq = self.r["equal_compute_steps"]
        return eq[setting] if setting in eq else eq

    def has(self, setting: str, arm: str) -> bool:
        return arm in self.r["settings"].get(setting, {}).get("eval", {})

    def has_replay(self, setting: str, arm: str) -> bool:
        return arm in ((self.r["settings"].get(setting, {}).get("reuse") or {}).get("policies") or {})

    def native(self, setting: str, arm: str) -> dict[str, Any]:
        """One arm's per-seed numbers in one setting, in the keys ``bench.quality.analysis`` computes them."""
        st = self.r["settings"][setting]
        out = {k: st[k][arm] for k in ("eval", "test_curves", "val_curves", "compute_curves", "final_val",
                                       "step_seconds", "part_seconds", "kept_share", "param_distance")}
        out["delta_over_time"] = st["delta_over_time"].get(arm)
        if arm == "rho1":
            out["static_reference"] = st["static_reference"]
        return out

    def replay(self, setting: str, arm: str) -> dict[str, Any]:
        """One replayed arm's per-seed final scores and mean curve over target steps."""
        e = self.r["settings"][setting]["reuse"]["policies"][arm]
        return {"final": e["final"], "curve_steps": [tuple(x) for x in e["curve_steps"]]}


def _flatten(x: Any, prefix: str = "") -> dict[str, float]:
    if isinstance(x, dict):
        return {k: v for key in sorted(x) for k, v in _flatten(x[key], f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(x, list | tuple):
        return {k: v for i, item in enumerate(x) for k, v in _flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: x}


class Checks:
    """Bit-for-bit comparisons of numbers trained again with the recorded ones (``Runs.checks``)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def compare(self, what: str, ours: Any, recorded: Any) -> bool:
        """Record whether ``ours`` equals ``recorded`` exactly (same structure, every float equal); returns it."""
        a, b = _flatten(_plain(ours)), _flatten(_plain(recorded))
        diffs = [abs(a[k] - b[k]) for k in a.keys() & b.keys()
                 if isinstance(a[k], float | int) and isinstance(b[k], float | int) and a[k] != b[k]]
        equal = a.keys() == b.keys() and all(a[k] == b[k] for k in a)
        row = {"what": what, "equal": equal, "numbers": len(a),
               "max_abs_diff": max(diffs, default=0.0 if equal else math.nan)}
        if a.keys() != b.keys():
            row["keys_differ"] = sorted(a.keys() ^ b.keys())[:5]
        self.rows = [r for r in self.rows if r["what"] != what] + [row]
        print(f"[recorded] {what}: {'equal, bit for bit' if equal else 'DIFFERS'} ({len(a)} numbers"
              + ("" if equal else f", max |Δ| {row['max_abs_diff']:.3g}") + ")", flush=True)
        return equal

    @property
    def passed(self) -> bool:
        return all(r["equal"] for r in self.rows)

    def failed(self) -> list[str]:
        return [r["what"] for r in self.rows if not r["equal"]]
