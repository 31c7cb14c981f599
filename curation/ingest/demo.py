"""The embedded demo corpus: a small domain-shift setting generated locally (no downloads).

* ``target.jsonl``: templated arithmetic word problems with worked solutions (``question``/``answer``),
  the domain the model should move toward;
* ``general.jsonl``: off-domain general prose built from sentence templates (``text``);
* ``noise.jsonl``: web boilerplate and random character strings (``text``);
* ``target_val.jsonl``: more target problems from a disjoint seed stream: the validation (target) set.

Sized so the whole demo pipeline runs in a few minutes on 2 CPU cores (≈ 0.5M tokens).
"""

from __future__ import annotations

import json
import os
import random

from curation.io.atomic import atomic_write_text

__all__ = ["DEMO_FILES", "DEFAULT_SIZES", "write_demo_corpus", "math_problem", "general_text", "noise_text"]

DEMO_FILES = ("target.jsonl", "general.jsonl", "noise.jsonl", "target_val.jsonl")
DEFAULT_SIZES = {"target": 1500, "general": 2000, "noise": 1000, "target_val": 300}

_NAMES = ["Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jamal", "Kenji", "Lena",
          "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "eggs"]
_TOPICS = {
    "weather": ["The morning fog rolled over the hills", "Rain fell steadily on the old town",
                "A warm wind came from the south", "The sky cleared after the storm"],
    "history": ["The city was founded by traders", "An old bridge once linked the two villages",
                "The castle walls were rebuilt twice", "Merchants sailed along the river for centuries"],
    "cooking": ["The soup simmered for an hour", "Fresh bread was baked before dawn",
                "She seasoned the stew with thyme", "The market sold ripe tomatoes and herbs"],
    "travel": ["The train wound through the valley", "They camped beside a quiet lake",
               "The road climbed toward the pass", "Visitors crowded the narrow harbour streets"],
}
_CLAUSES = ["and nobody seemed to mind", "while the children played outside", "as the bells rang in the square",
            "though few people remembered why", "and the evening light turned gold",
            "before the shops closed for the night", "which surprised the visitors", "and the dogs barked"]
_BOILER = ["Click here to subscribe to our newsletter!", "We use cookies to improve your experience.",
           "All rights reserved.", "Accept all cookies", "Share this on social media", "Log in | Sign up",
           "Terms of service | Privacy policy", "Read more >>", "Advertisement", "Home > Blog > Archive"]


def math_problem(rng: random.Random) -> dict[str, str]:
    """One templated word problem with a worked, step-by-step solution ending in ``#### answer``."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
        q = f"{name} has {a} {item}. {name} buys {b} more and gives {c} to {other}. How many {item} does {name} have now?"
        s1, s2 = a + b, a + b - c
        ans = (f"{name} starts with {a} {item}. After buying {b} more, {name} has {a} + {b} = {s1}. "
               f"After giving {c} to {other}, {name} has {s1} - {c} = {s2}.\n#### {s2}")
    elif kind == 1:
        n, p = rng.randint(2, 12), rng.randint(2, 25)
        q = f"Each pack of {item} costs {p} dollars. {name} buys {n} packs. How much does {name} spend?"
        ans = f"{name} buys {n} packs at {p} dollars each, so {name} spends {n} * {p} = {n * p} dollars.\n#### {n * p}"
    elif kind == 2:
        k, per = rng.randint(2, 9), rng.randint(2, 15)
        total = k * per
        q = f"{name} shares {total} {item} equally among {k} friends. How many {item} does each friend get?"
        ans = f"{name} has {total} {item} for {k} friends, so each friend gets {total} / {k} = {per} {item}.\n#### {per}"
    else:
        a, b, m = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 6)
        q = (f"{name} collects {a} {item} on Monday and {b} {item} on Tuesday. On Wednesday {name} collects "
             f"{m} times as many as on Monday. How many {item} did {name} collect in total?")
        w = a * m
        ans = (f"On Wednesday {name} collects {m} * {a} = {w} {item}. In total {name} collects "
               f"{a} + {b} + {w} = {a + b + w} {item}.\n#### {a + b + w}")
    return {"question": q, "answer": ans}


def general_text(rng: random.Random) -> str:
    topic = rng.choice(sorted(_TOPICS))
    sentences = [f"{rng.choice(_TOPICS[topic])}, {rng.choice(_CLAUSES)}." for _ in range(rng.randint(3, 7))]
    return " ".join(sentences)


def noise_text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return "\n".join(rng.choice(_BOILER) for _ in range(rng.randint(3, 8)))
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789#@%&"
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9))) for _ in range(rng.randint(15, 40))]
    return " ".join(words)


def _write_jsonl(path: str, rows: list[dict[str, str]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_demo_corpus(raw_dir: str, *, seed: int = 0, sizes: dict[str, int] | None = None) -> list[str]:
    """Write the four demo files into ``raw_dir`` (deterministic for a seed); returns their paths.

    Existing complete files are kept (each file is written atomically, so a file that exists is whole).
    """
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    os.makedirs(raw_dir, exist_ok=True)
    makers = {
        "target": lambda r: math_problem(r),
        "general": lambda r: {"text": general_text(r)},
        "noise": lambda r: {"text": noise_text(r)},
        "target_val": lambda r: math_problem(r),
    }
    paths = []
    for i, (name, make) in enumerate(makers.items()):
        path = os.path.join(raw_dir, f"{name}.jsonl")
        paths.append(path)
        if os.path.exists(path):
            continue
        rng = random.Random(f"{seed}-{i}-{name}")
        _write_jsonl(path, [make(rng) for _ in range(sizes[name])])
    return paths
