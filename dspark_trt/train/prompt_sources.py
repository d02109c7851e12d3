"""Prompt sources at scale for target-generated distillation data (thousands of varied prompts).

Owns: deterministic prompt builders drawn from what this machine has — Python standard-library
signatures + docstrings (code), sentences of installed plain-text documentation (rewriting, summaries),
templated math word problems with random numbers, list and explanation requests — and `varied_prompts`,
which mixes them, dedupes them (case/space-insensitive) and drops any prompt of the held-out set.
Pure Python, no model code.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import random
import re
import sys
import warnings
from pathlib import Path

from dspark_trt.train.prompts import HELD_OUT_PROMPTS, _SUBJECTS, training_prompts

log = logging.getLogger(__name__)

_SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "lib2to3",
                 "pydoc_data", "test", "xxsubtype", "__future__", "__hello__", "__phello__"}
_PATCHED = {("inspect", "getfile")}  # torch replaces it on import
_CODE_FORMS = [
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. It should: {doc}",
    "Complete this Python function:\n\n```python\ndef {sig}:\n    \"\"\"{doc}\"\"\"\n```",
    "Explain what `{mod}.{name}` in the Python standard library does and show a short example.",
    "How do I use `{mod}.{name}` in Python? Give an example.",
    "Write a unit test with pytest for a function `{sig}` that does this: {doc}",
]


def stdlib_functions(limit: int = 5000) -> list[tuple[str, str, str, str]]:
    """(module, name, signature, first docstring sentence) of public stdlib functions, sorted."""
    out: list[tuple[str, str, str, str]] = []
    for mod_name in sorted(sys.stdlib_module_names):
        if mod_name.startswith("_") or mod_name in _SKIP_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - platform-specific modules fail to import; skip them
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            owner = (getattr(obj, "__module__", None) or "").split(".")[0]
            if (mod_name, name) in _PATCHED or (owner and owner not in sys.stdlib_module_names and owner != "builtins"):
                continue  # replaced by an installed package once imported: the list must not depend on imports
            doc = inspect.getdoc(obj) or ""
            first = re.split(r"(?<=\.)\s|\n\n", doc.strip(), maxsplit=1)[0].replace("\n", " ").strip()
            if len(first) < 20 or len(first) > 300 or first.startswith(name + "("):
                continue
            try:
                sig = f"{name}{inspect.signature(obj)}"
            except (TypeError, ValueError):
                continue
            if len(sig) > 120 or "<" in sig:  # reprs such as <function copy2 at 0x…> differ per process
                continue
            out.append((mod_name, name, sig, first))
            if len(out) >= limit:
                return out
    return out


def _doc_sentences(roots: tuple[Path, ...], limit: int) -> list[str]:
    """Plain sentences (60–220 chars, mostly letters) from installed README/text docs, sorted + deduped."""
    seen: set[str] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for f in sorted(root.rglob("*")):
            if not f.is_file() or f.suffix not in ("", ".txt", ".md") or f.stat().st_size > 200_000:
                continue
            if "copyright" in f.name.lower() or "changelog" in f.name.lower():
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text)):
                letters = sum(c.isalpha() or c == " " for c in s)
                if 60 <= len(s) <= 220 and letters > 0.9 * len(s) and s[0].isupper() and "http" not in s:
                    seen.add(s)
            if len(seen) >= 4 * limit:
                break
    return sorted(seen)


_REWRITE_FORMS = [
    "Rewrite this sentence in simpler words: \"{s}\"", "Make this sentence more formal: \"{s}\"",
    "Explain what this means to a beginner: \"{s}\"", "Translate this sentence into French: \"{s}\"",
    "Turn this sentence into a question: \"{s}\"", "Summarize in a few words: \"{s}\"",
    "Fix the grammar and style of this text, if needed: \"{s}\"", "Write a short paragraph expanding on: \"{s}\"",
]
_WORD_PROBLEMS = [
    "{n1} has {a} {item}s. {n2} gives {n1} {b} more. How many {item}s does {n1} have now?",
    "A box holds {b} {item}s. How many boxes are needed for {c} {item}s?",
    "{n1} buys {a} {item}s at {b} dollars each and pays with a {d}-dollar bill. How much change does {n1} get?",
    "A recipe needs {b} grams of flour per cake. How much flour is needed for {a} cakes?",
    "{n1} reads {b} pages a day. How many days does it take to read a {c}-page book?",
    "A bus carries {a} people. At the first stop {b} get off and {e} get on. How many are on the bus now?",
    "The price of a {item} is {c} dollars. It is discounted by {p}%. What is the new price?",
    "{n1} runs {a} km every week. How far does {n1} run in {b} weeks?",
    "A garden is {a} m long and {b} m wide. What is its perimeter and its area?",
    "{n1} saves {b} dollars a month. How long until {n1} has {c} dollars?",
    "A class has {a} students; {p}% of them walk to school. How many walk?",
    "What is the average of {a}, {b}, {c} and {e}?",
    "Convert {c} minutes into hours and minutes.",
    "If {a} workers build a wall in {b} days, how long would {e} workers take at the same rate?",
    "Write {c} as a product of prime factors.",
    "What is {a}/{b} as a decimal, rounded to two places?",
]
_NAMES = ["Anna", "Ben", "Carla", "David", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
          "Maya", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
_ITEMS = ["apple", "pencil", "book", "marble", "cookie", "sticker", "card", "egg", "orange", "ticket", "coin"]
_LIST_FORMS = [
    "List {k} {what}.", "Give me a list of {k} {what}, one per line.", "Name {k} {what} and say one thing about each.",
    "Make a numbered list of {k} {what}.", "What are {k} {what}? Answer as a bulleted list.",
]
_LIST_WHATS = [
    "ways to save energy at home", "famous scientists", "programming languages", "healthy breakfast ideas",
    "countries in Europe", "board games for families", "tips for better sleep", "uses of Python",
    "common Linux commands", "things to do on a rainy day", "fruits high in vitamin C", "kinds of clouds",
    "musical instruments", "classic novels", "ways to reduce stress", "data structures", "sorting algorithms",
    "HTTP status codes", "git commands", "planets of the solar system", "world capitals", "kitchen tools",
    "questions to ask in a job interview", "benefits of reading", "birds that cannot fly", "renewable energy sources",
    "SQL keywords", "ways to learn a language", "inventions of the 20th century", "rules for writing clearly",
]
_EXPLAIN_FORMS = [
    "What is the difference between {a} and {b}?", "Which is better for a beginner, {a} or {b}? Why?",
    "Explain how {a} relates to {b}.", "Write a short dialogue between two friends about {a}.",
    "Describe {a} in exactly three sentences.", "What would happen if there were no {a}?",
    "Give a step-by-step guide to {a}.", "Write a haiku about {a}.",
]


def code_prompts(rng: random.Random, n: int) -> list[str]:
    funcs = stdlib_functions()
    rng.shuffle(funcs)
    out = []
    for i, (mod, name, sig, doc) in enumerate(funcs[:n]):
        out.append(_CODE_FORMS[i % len(_CODE_FORMS)].format(mod=mod, name=name, sig=sig, doc=doc))
    return out


def rewrite_prompts(rng: random.Random, n: int,
                    roots: tuple[Path, ...] = (Path("/usr/share/doc"), Path(sys.prefix) / "lib")) -> list[str]:
    sents = _doc_sentences(roots, n)
    rng.shuffle(sents)
    return [rng.choice(_REWRITE_FORMS).format(s=s) for s in sents[:n]]


def math_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b, e = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 30)
        out.append(rng.choice(_WORD_PROBLEMS).format(
            n1=rng.choice(_NAMES), n2=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b, e=e,
            c=rng.randint(50, 900), d=rng.choice([20, 50, 100]), p=rng.choice([5, 10, 15, 20, 25, 30, 40, 50])))
    return out


def list_and_explain_prompts(rng: random.Random, n: int) -> list[str]:
    out = [f.format(k=k, what=w) for w in _LIST_WHATS for f in _LIST_FORMS for k in (3, 5, 7)]
    subs = list(_SUBJECTS)
    for _ in range(n):
        a, b = rng.sample(subs, 2)
        out.append(rng.choice(_EXPLAIN_FORMS).format(a=a, b=b))
    rng.shuffle(out)
    return out[:n]


def _key(p: str) -> str:
    return re.sub(r"\s+", " ", p.strip().lower())


def varied_prompts(n: int = 6000, seed: int = 0) -> list[str]:
    """About n deduped prompts mixed from every source (code ~35%, rewriting ~20%, math ~15%, lists/explanations
    ~15%, the template set ~15%), shuffled; none equals a held-out prompt."""
    rng = random.Random(seed)
    parts: list[str] = []
    parts += code_prompts(rng, int(0.35 * n))
    parts += rewrite_prompts(rng, int(0.20 * n))
    parts += math_prompts(rng, int(0.15 * n))
    parts += list_and_explain_prompts(rng, int(0.15 * n))
    parts += training_prompts(seed)
    held = {_key(p) for _, p in HELD_OUT_PROMPTS}
    seen: set[str] = set()
    out: list[str] = []
    for p in parts:
        k = _key(p)
        if k in seen or k in held:
            continue
        seen.add(k)
        out.append(p)
    rng.shuffle(out)
    log.info("varied_prompts: %d unique prompts (%d before dedupe)", len(out), len(parts))
    return out[:n]


if __name__ == "__main__":  # inspection: python -m dspark_trt.train.prompt_sources
    logging.basicConfig(level=logging.INFO)
    for p in varied_prompts()[:20]:
        log.info("--- %s", p)
