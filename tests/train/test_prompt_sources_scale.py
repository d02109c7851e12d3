"""The 30k prompt mix and its sources: size, dedupe, held-out exclusion, determinism, source mix, the bug-fix
mutation, self-instruct cleaning and multi-turn follow-up items (real sources on this machine, no mocks)."""
from __future__ import annotations

import ast
import json
import random
import re
from fractions import Fraction

import pytest

from dspark_trt.train import prompt_sources_scale as pss
from dspark_trt.train.prompt_sources import _key, varied_prompts
from dspark_trt.train.prompts import HELD_OUT_PROMPTS


def _code_block(prompt: str) -> str:
    m = re.search(r"```python\n(.*)\n```", prompt, re.S)
    assert m, prompt
    return m.group(1)


@pytest.fixture(scope="module")
def scaled() -> list[str]:
    pss._PyScan._cache.clear()
    return pss.scaled_prompts(30000)


def test_scaled_prompts_size_order_dedupe_and_held_out(scaled: list[str]) -> None:
    assert len(scaled) >= 30000
    assert len({_key(p) for p in scaled}) == len(scaled)
    base = varied_prompts(6000, seed=0)
    assert scaled[:len(base)] == base
    held = [_key(p) for _, p in HELD_OUT_PROMPTS]
    assert not [p for p in scaled if any(h in _key(p) for h in held)]
    assert max(len(p) for p in scaled[len(base):]) <= 1800


def test_scaled_prompts_mixes_sources(scaled: list[str]) -> None:
    new = scaled[6000:]
    code = sum("```" in p or "def " in p for p in scaled)
    assert code >= 0.2 * len(scaled)
    assert sum("```python" in p for p in new) >= 0.3 * len(new)  # package code ~35% of the new part
    doc_heads = tuple(f.split("{p}")[0] for f in pss._DOC_FORMS)
    assert sum(p.startswith(doc_heads) for p in new) >= 0.15 * len(new)
    assert sum(bool(re.search(r"\d", p)) and "```" not in p for p in new) >= 0.15 * len(new)  # math
    kinds = {form: sum(p.startswith(tuple(h.split("{")[0] for h in heads)) for p in new)
             for form, heads in pss._PKG_FORMS.items()}
    assert all(v > 0 for v in kinds.values()), kinds


def test_scaled_prompts_deterministic() -> None:
    pss._PyScan._cache.clear()
    a = pss.scaled_prompts(9000, seed=1, extra=["Write one haiku about tea kettles, please."])
    pss._PyScan._cache.clear()
    b = pss.scaled_prompts(9000, seed=1, extra=["Write one haiku about tea kettles, please."])
    assert a == b and len(a) == 9000
    assert a[len(varied_prompts(6000, 0))] == "Write one haiku about tea kettles, please."


def test_bug_fix_mutation_changes_code_and_parses() -> None:
    src = "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    return min(x, hi + 0)\n"
    orig = ast.unparse(ast.parse(src))
    for choice in range(4):
        mutated = pss.mutate_code(src, choice)
        assert mutated is not None and mutated != orig
        ast.parse(mutated)
    assert "x <= lo" in pss.mutate_code(src, 0)
    assert pss.mutate_code("def f():\n    return [10]\n") == "def f():\n    return [11]"
    assert pss.mutate_code("def f(a):\n    return a\n") is None
    assert pss.mutate_code("def broken(:\n") is None


def test_package_code_prompts_forms_parse() -> None:
    prompts = pss.package_code_prompts(random.Random(0), 140)
    assert len(prompts) == 140 and len(set(prompts)) == 140
    bug = [p for p in prompts if "bug" in p.split("\n")[0]]
    stubs = [p for p in prompts if p.startswith(("Complete this Python", "Implement the body"))]
    assert bug and stubs
    for p in bug + stubs:
        tree = ast.parse(_code_block(p))
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
    for p in stubs:
        fn = ast.parse(_code_block(p)).body[0]
        assert len(fn.body) == 1 and ast.get_docstring(fn)
    assert all(len(p) <= 1800 for p in prompts)


def test_doc_paragraph_prompts_are_prose() -> None:
    prompts = pss.doc_paragraph_prompts(random.Random(0), 60)
    assert len(prompts) == 60
    for p in prompts:
        para = p.split("\n\n", 1)[1].strip('"')
        assert 200 <= len(para) <= 900 and "://" not in para and "www." not in para and "```" not in para


def test_math_prompts_v2_varied_and_solvable() -> None:
    prompts = pss.math_prompts_v2(random.Random(0), 3000)
    assert len(set(prompts)) >= 2500 and all(re.search(r"\d", p) for p in prompts)
    starts = {p.split()[0] for p in prompts}
    assert len(starts) >= 15
    solved = 0
    for p in prompts:
        m = re.match(r"Solve for x: (\d*)x ([+-]) (\d+) = (-?\d+)", p)
        if m:
            a, b = int(m.group(1) or 1), int(m.group(3)) * (1 if m.group(2) == "+" else -1)
            assert Fraction(int(m.group(4)) - b, a).denominator == 1
            solved += 1
    assert solved > 20


def test_self_instruct_seeds_and_cleaning() -> None:
    seeds = pss.self_instruct_seed_prompts(random.Random(0), 600)
    assert len(set(seeds)) == 600 and all(s.startswith("Write one") and "only." in s for s in seeds)
    assert len(pss._TOPICS) >= 150 and len(pss._PERSONAS) >= 12 and len(pss._KINDS) >= 8
    answers = [
        'Question: "How do volcanoes form?"',
        "1. Write a Python function that sorts a list of tuples by the second item.",
        "Sure! Here is a question:\n**Q:** Why is the sky blue during the day?<|im_end|>",
        "how do   volcanoes form?",
        "As an AI, I would ask: what is the meaning of friendship?",
        "Hi?",
        "- Explain how ocean tides work. Use simple words.",
        f"Question 3: {HELD_OUT_PROMPTS[7][1]}",
        "Here's one: what is the difference between a list and a tuple in Python?",
    ]
    assert pss.questions_from_answers(answers) == [
        "How do volcanoes form?",
        "Write a Python function that sorts a list of tuples by the second item.",
        "Why is the sky blue during the day?",
        "Explain how ocean tides work.",
        "What is the difference between a list and a tuple in Python?",
    ]


def _decode(ids: list[int]) -> str:
    return " ".join("<|im_end|>" if i == 0 else str(i) for i in ids)


def test_follow_up_items_and_prompt_key() -> None:
    records = [
        {"prompt": "Write a Python function that reverses a string.", "ids": [1, 2, 3] + list(range(100, 110)) + [0],
         "prompt_len": 3},
        {"prompt": "What is 15 plus 27?", "ids": [5, 6] + list(range(200, 210)), "prompt_len": 2},
        {"prompt": "Explain the water cycle.", "ids": [7] + list(range(300, 312)) + [0], "prompt_len": 1},
        {"prompt": ["not", "a", "string"], "ids": list(range(400, 420)), "prompt_len": 1},
        {"prompt": "Too short an answer here.", "ids": [1, 2, 3], "prompt_len": 1},
    ]
    items = pss.follow_up_items(records, random.Random(0), 10, _decode)
    assert pss.follow_up_items(records, random.Random(0), 10, _decode) == items
    assert len(items) == 3 and len(pss.follow_up_items(records, random.Random(0), 2, _decode)) == 2
    by_prompt = {it[0]["content"]: it for it in items}
    for rec in records[:3]:
        user, asst, follow = by_prompt[rec["prompt"]]
        assert [m["role"] for m in (user, asst, follow)] == ["user", "assistant", "user"]
        assert asst["content"] == _decode(rec["ids"][rec["prompt_len"]:]).removesuffix("<|im_end|>").strip()
        assert "<|im_end|>" not in asst["content"]
        kind = pss.prompt_kind(rec["prompt"])
        assert follow["content"] in pss._FOLLOW_UPS[kind]
    assert [pss.prompt_kind(r["prompt"]) for r in records[:3]] == ["code", "math", "other"]
    passage = "Read the passage and answer: what is the main idea of this passage?\n\n" + "In 1990 the city grew. " * 12
    assert pss.prompt_kind(passage) == "other"
    assert sum(len(v) for v in pss._FOLLOW_UPS.values()) >= 12
    for it in items:
        key = pss.prompt_key(it)
        assert json.loads(key) == list(it) and isinstance(key, str)
    assert pss.prompt_key("Explain gravity.") == "Explain gravity."
