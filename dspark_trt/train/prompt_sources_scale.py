"""Prompt sources at the 30k scale for target-generated distillation data, and multi-turn follow-ups.

Owns: prompts drawn from the code and documentation installed on this machine (functions and methods of
site-packages / stdlib sources parsed with `ast`, never imported; prose paragraphs of installed docs and
docstrings), a wider math generator, self-instruct seeds (prompts asking the target to write one question)
and the cleaning of its replies back into prompts, multi-turn follow-up items built on existing chat records,
`prompt_key` (the string an item is stored and deduped under) and `scaled_prompts`, which keeps the existing
`varied_prompts(6000, 0)` first and fills up to n deduped prompts, none equal to or containing a held-out one.
The wordings and vocabularies it draws from (task forms, math forms, topics, follow-ups) live in `prompt_tables`.
Pure Python, no model code.
"""
from __future__ import annotations

import ast
import contextlib
import gc
import gzip
import json
import logging
import os
import random
import re
import site
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from dspark_trt.train.prompt_sources import (_ITEMS, _NAMES, _key, list_and_explain_prompts, math_prompts,
                                             rewrite_prompts, varied_prompts)
from dspark_trt.train.prompt_tables import (_DOC_FORMS, _FOLLOW_UPS, _KINDS, _MATH_FORMS, _MATH_TAILS,
                                            _PERSONAS, _PKG_FORMS, _TOPICS, _UNITS)
from dspark_trt.train.prompts import HELD_OUT_PROMPTS, _SUBJECTS, training_prompts

log = logging.getLogger(__name__)

_SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "site-packages", "dist-packages", "idlelib",
              "turtledemo", "lib2to3", "ensurepip", "pydoc_data"}
_MAX_FILE = 300_000
_MAX_PROMPT = 1800


def _default_roots() -> tuple[Path, ...]:
    roots = [Path(p) for p in site.getsitepackages()] + [Path(sysconfig.get_paths()["stdlib"])]
    return tuple(dict.fromkeys(r for r in roots if r.is_dir()))


def _walk(path: Path, match: Callable[[str], bool]) -> Iterator[Path]:
    """Matching files under path (or path itself), in sorted order, skipping test and cache folders."""
    if path.is_file():
        yield from [path] if match(path.name) else []
        return
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        yield from (Path(dirpath) / f for f in sorted(filenames) if match(f))


def _round_robin(roots: Iterable[Path], match: Callable[[str], bool]) -> Iterator[Path]:
    """One file (≤ 300 KB) from each top-level entry (package) of each root in turn, so that an early stop still
    spans many packages."""
    gens = [_walk(e, match) for r in roots if r.is_dir() for e in sorted(r.iterdir())
            if e.name not in _SKIP_DIRS and not e.name.startswith(".")]
    while gens:
        alive = []
        for g in gens:
            if (f := next(g, None)) is not None:
                alive.append(g)
                with contextlib.suppress(OSError):  # a dangling link
                    if f.stat().st_size <= _MAX_FILE:
                        yield f
        gens = alive


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Cyclic GC off for a parse-heavy stretch (ASTs are freed by refcount; with torch loaded, the collector's
    passes over its big heap would double the walk's time); restored afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _PyScan:
    """Resumable walk of .py files shared by the code and doc sources: functions and methods of 4–30 lines
    (where, name, dedented source, docstring) and prose paragraphs of docstrings, in discovery order."""

    _cache: dict[tuple[Path, ...], _PyScan] = {}

    def __init__(self, roots: tuple[Path, ...]) -> None:
        self.files = _round_robin(roots, lambda n: n.endswith(".py"))
        self.funcs: list[tuple[str, str, str, str | None]] = []
        self.paras: dict[str, None] = {}
        self._seen: set[str] = set()

    @classmethod
    def of(cls, roots: tuple[Path, ...]) -> _PyScan:
        return cls._cache.setdefault(roots, cls(roots))

    def ensure(self, funcs: int = 0, paras: int = 0) -> _PyScan:
        with _gc_paused():
            self._fill(funcs, paras)
        return self

    def _fill(self, funcs: int, paras: int) -> None:
        while len(self.funcs) < funcs or len(self.paras) < paras:
            path = next(self.files, None)
            if path is None:
                break
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
                continue
            self._add(path.stem, text.split("\n"), tree)  # read_text already made every newline "\n"

    def _add(self, mod: str, lines: list[str], tree: ast.Module) -> None:
        for node in [tree, *tree.body]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.paras.update(dict.fromkeys(_paragraphs(ast.get_docstring(node) or "")))
        for node in tree.body:
            owner, fns = (node.name, node.body) if isinstance(node, ast.ClassDef) else ("", [node])
            for fn in fns:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("test"):
                    continue
                doc = ast.get_docstring(fn)
                body = fn.body[1:] if doc is not None else fn.body  # ≥ 3 lines of code besides the docstring
                if not 4 <= (fn.end_lineno or 0) - fn.lineno + 1 <= 30 or not body \
                        or (fn.end_lineno or 0) - body[0].lineno < 2:
                    continue
                # whole lines, what ast.get_source_segment(padded=True) gives, without its per-call re-split of
                # the file (that re-split made the walk ~20x slower)
                src = textwrap.dedent("\n".join(lines[fn.lineno - 1:fn.end_lineno])).strip("\n")
                if src and len(src) <= 1300 and src not in self._seen:
                    self._seen.add(src)
                    self.funcs.append((f"{mod}.{owner}" if owner else mod, fn.name, src, doc))


_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq}
_BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add}


def mutate_code(src: str, choice: int = 0) -> str | None:
    """src with one deterministic bug (a comparison flipped, + ↔ -, or else an integer constant off by one) as
    `ast.unparse` text, or None when src does not parse or has nothing to mutate."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return None
    ops: list[tuple[ast.AST, int]] = []
    ints: list[ast.Constant] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            ops += [(node, i) for i, op in enumerate(node.ops) if type(op) in _CMP_SWAP]
        elif isinstance(node, ast.BinOp) and type(node.op) in _BIN_SWAP:
            ops.append((node, -1))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            ints.append(node)
    if not ops and not ints:
        return None
    before = ast.unparse(tree)
    if ops:  # operator flips read as real bugs; constants only when there is no operator to flip
        node, i = ops[choice % len(ops)]
        if isinstance(node, ast.Compare):
            node.ops[i] = _CMP_SWAP[type(node.ops[i])]()
        elif isinstance(node, ast.BinOp):
            node.op = _BIN_SWAP[type(node.op)]()
    else:
        ints[choice % len(ints)].value += 1
    after = ast.unparse(tree)
    return after if after != before else None


def _stub(src: str) -> str | None:
    """The function's signature and docstring (as written) only, decorators dropped; None without a docstring."""
    try:
        fn = ast.parse(src).body[0]
    except (SyntaxError, ValueError, IndexError):
        return None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(fn, clean=False) is None:
        return None
    fn.decorator_list, fn.body = [], fn.body[:1]
    return ast.unparse(fn)


_PKG_ORDER = tuple(_PKG_FORMS)


def package_code_prompts(rng: random.Random, n: int, roots: tuple[Path, ...] | None = None) -> list[str]:
    """Up to n code tasks over functions of installed sources (the first 4·n found); the form rotates, skipping
    'complete' without a docstring and 'bugfix' where no mutation is possible."""
    funcs = _PyScan.of(roots or _default_roots()).ensure(funcs=4 * n).funcs[:4 * n]
    rng.shuffle(funcs)
    out: list[str] = []
    for i, (where, _name, src, doc) in enumerate(funcs):
        if len(out) >= n:
            break
        for j in range(len(_PKG_ORDER)):
            form = _PKG_ORDER[(i + j) % len(_PKG_ORDER)]
            code = src
            if form == "complete":
                code = _stub(src) if doc else None
            elif form == "bugfix":
                code = mutate_code(src, rng.randrange(1 << 16))
            p = f"{rng.choice(_PKG_FORMS[form]).format(where=where)}\n\n```python\n{code}\n```"
            if code is not None and len(p) <= _MAX_PROMPT:
                out.append(p)
                break
    log.info("package_code_prompts: %d prompts from %d functions", len(out), len(funcs))
    return out


_DOC_SKIP = ("copyright", "license", "licence", "copying", "changelog", "changes", "news", "history", "authors",
             "record", "entry_points", "top_level", "requirements", "sources", "thanks", "wheel")
_BAD = re.compile(r"https?:|www\.|```|>>>|::|\||\{|\}|\t|={3,}|-{3,}|\*\*|:\w+:`|\\|<[a-z/]|\$ |@"
                  r"|warranty|license|copyright", re.I)
_MARKUP = ("#", "*", "-", "+", ">", "..", "=", "[", "|", "$", "%", "/")


def _doc_file(name: str) -> bool:
    low = name.lower().removesuffix(".gz")
    if any(s in low for s in _DOC_SKIP):
        return False
    return low.endswith((".md", ".rst", ".txt")) or low == "metadata" or low.startswith(("readme", "faq"))


def _paragraphs(text: str) -> Iterator[str]:
    """Prose paragraphs of 200–900 characters: no URLs, tables, lists, code or markup; mostly lower-case letters."""
    for block in re.split(r"\n\s*\n", text):
        if not 200 <= len(block) <= 1200:
            continue
        lines = [ln.strip() for ln in block.strip("\n").splitlines()]
        if any(ln.startswith(_MARKUP) or ln[:2].rstrip(".)").isdigit() for ln in lines if ln):
            continue
        p = " ".join(ln for ln in lines if ln)
        if not 200 <= len(p) <= 900 or not p[0].isupper() or p[-1] not in ".!?" or _BAD.search(p):
            continue
        letters = sum(c.isalpha() or c == " " for c in p)
        if letters >= 0.9 * len(p) and sum(c.isupper() for c in p) <= 0.08 * len(p) and ". " in p \
                and p.count("`") <= 4:
            yield p


def _doc_paragraphs(roots: tuple[Path, ...], want: int) -> list[str]:
    """Up to want paragraphs of installed docs (/usr/share/doc, *.md/*.rst/*.txt/METADATA under the roots), then
    of docstrings; deduped, in discovery order."""
    seen: dict[str, None] = {}
    for path in _round_robin((Path("/usr/share/doc"), *roots), _doc_file):
        if len(seen) >= want:
            break
        try:
            raw = path.read_bytes()
            text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        seen.update(dict.fromkeys(_paragraphs(text)))
    if len(seen) < want:
        seen.update(dict.fromkeys(_PyScan.of(roots).ensure(paras=want - len(seen)).paras))
    return list(seen)[:want]


def doc_paragraph_prompts(rng: random.Random, n: int, roots: tuple[Path, ...] | None = None) -> list[str]:
    """Up to n reading tasks over installed-documentation paragraphs (a paragraph gets at most two forms)."""
    paras = _doc_paragraphs(roots or _default_roots(), n)
    rng.shuffle(paras)
    out = [_DOC_FORMS[(i + k) % len(_DOC_FORMS)].format(p=p) for k in (0, 3) for i, p in enumerate(paras)]
    log.info("doc_paragraph_prompts: %d paragraphs -> %d prompts", len(paras), min(n, len(out)))
    return out[:n]


def _sequence(rng: random.Random) -> list[int]:
    s, d, k = rng.randint(1, 12), rng.randint(2, 9), rng.randrange(5)
    if k == 3:
        seq = [s, d]
        while len(seq) < 5:
            seq.append(seq[-1] + seq[-2])
        return seq
    return [[s + i * d for i in range(5)], [s * d ** i for i in range(4)], [(s + i) ** 2 for i in range(5)], [],
            [s + i * (i + 1) // 2 * d for i in range(5)]][k]


def _lin(a: int, b: int) -> str:
    return f"{a if a != 1 else ''}x {'+' if b >= 0 else '-'} {abs(b)}"


def math_prompts_v2(rng: random.Random, n: int) -> list[str]:
    """n math problems over a wide range of kinds, numbers drawn from rng."""
    out = []
    for _ in range(n):
        r = rng.randint
        a, b, c, d, h, t, k, x = r(2, 12), r(2, 12), r(1, 9), r(2, 12), r(2, 20), r(2, 9), r(2, 7), r(-15, 20)
        v, w, sp, sp2, e = r(20, 2000), r(10, 400), r(4, 120), r(4, 120), r(-30, 30)
        c2 = r(1, a - 1)
        u1, u2 = rng.choice(_UNITS)
        p = rng.choice((5, 8, 12, 15, 20, 25, 30, 35, 40, 60, 75))
        expr = str(r(2, 99)) + "".join(f" {rng.choice('+-×')} {r(2, 99)}" for _ in range(r(2, 4)))
        vals = dict(a=a, b=b, c=c, d=d, h=h, t=t, k=k, v=v, w=w, vw=v + w, wp=w + w * p // 100, p=p, sp=sp, sp2=sp2,
                    spt=sp * t, gap=sp * t + sp2, s=r(2, 12), ac=a * c, bc=b * c, u1=u1, u2=u2, expr=expr,
                    lin=_lin(a, e), rhs=a * x + e, lin2=_lin(c2, a * x + e - c2 * x), sq=r(4, 40) ** 2,
                    seq=", ".join(map(str, _sequence(rng))), card=rng.choice(("heart", "king", "face card", "red ace")),
                    clock=f"{r(5, 20)}:{r(0, 59):02d}", dm=r(20, 400), nm=rng.choice(_NAMES), item=rng.choice(_ITEMS),
                    data=", ".join(str(r(1, 20)) for _ in range(r(5, 9))))
        out.append(rng.choice(_MATH_FORMS).format(**vals) + rng.choice(_MATH_TAILS))
    return out


def self_instruct_seed_prompts(rng: random.Random, n: int) -> list[str]:
    """Up to n distinct prompts asking the target to write ONE question or task (topics × personas × kinds)."""
    topics = tuple(dict.fromkeys((*_SUBJECTS, *_TOPICS)))
    per_topic = len(_PERSONAS) * len(_KINDS)
    out = []
    for idx in rng.sample(range(len(topics) * per_topic), min(n, len(topics) * per_topic)):
        t, rest = divmod(idx, per_topic)
        p, k = divmod(rest, len(_KINDS))
        what = "question" if "question" in _KINDS[k] else "task" if "task" in _KINDS[k] else "request"
        out.append(_KINDS[k].format(p=_PERSONAS[p], t=topics[t]) + f" Reply with the {what} only.")
    return out


_PREFIX = re.compile(r"^(?:\s*(?:[-*•#>]+|\(?\d{1,3}[.):]|(?:question|task|request|problem|prompt|q)\s*\d*\s*[:.-])"
                     r"\s*)+", re.I)
_IMPERATIVE = re.compile(r"^(write|explain|describe|create|implement|make|give|list|compare|design|build|tell|help|"
                         r"show|summarize|suggest|calculate|find|solve|plan|translate|draft|compose)\b", re.I)
_QUOTES = "\"'“”‘’*` "


def questions_from_answers(answers: Iterable[str]) -> list[str]:
    """Prompts cleaned from the target's self-instruct replies: per reply, the first line that reads as a question
    or an instruction, without quotes, 'Question:' prefixes or numbering; 15–300 chars, deduped by `_key`."""
    held = {_key(p) for _, p in HELD_OUT_PROMPTS}
    seen: set[str] = set()
    out: list[str] = []
    for ans in answers:
        for line in ans.replace("<|im_end|>", "\n").splitlines():
            q = _PREFIX.sub("", _PREFIX.sub("", line.strip()).strip(_QUOTES)).strip(_QUOTES)
            if "?" in q:
                q = q[:q.index("?") + 1]
                q = _PREFIX.sub("", q.rsplit(": ", 1)[-1] if ": " in q else q).strip(_QUOTES)
            elif _IMPERATIVE.match(q) and not q.endswith(":"):
                q = re.split(r"(?<=[.!])\s", q, maxsplit=1)[0].strip(_QUOTES)
            else:
                continue
            q = q[:1].upper() + q[1:]
            k = _key(q)
            if 15 <= len(q) <= 300 and "as an ai" not in line.lower() and k not in seen and k not in held:
                seen.add(k)
                out.append(q)
            break
    return out


_CODE_RE = re.compile(r"```|\bdef |\b(python|javascript|function|code|program|sql|bash|script|rust|java|regex)\b",
                      re.I)
_MATH_RE = re.compile(r"\b(solve|calculate|compute|how many|how much|what is|percent|probability|area|volume|"
                      r"average|convert|fraction|sequence|equation)\b|%|[-+×*/=]\s*\d", re.I)
_EOT = "<|im_end|>"


def prompt_kind(prompt: str) -> str:
    """'code', 'math' or 'other', by the prompt's words (math: short, with numbers and a math word or sign)."""
    if _CODE_RE.search(prompt):
        return "code"
    return "math" if len(prompt) < 300 and re.search(r"\d", prompt) and _MATH_RE.search(prompt) else "other"


def follow_up_items(records: Iterable[dict], rng: random.Random, n: int,
                    decode: Callable[[list[int]], str]) -> list[tuple[dict, ...]]:
    """Up to n (user, assistant, user) items: a record's prompt, its decoded answer (20–1,200 chars, end-of-turn
    text stripped) and a follow-up chosen by the prompt's kind."""
    pool: list[tuple[str, str]] = []
    for rec in records:
        prompt, ids, plen = rec.get("prompt"), rec.get("ids"), rec.get("prompt_len")
        if not isinstance(prompt, str) or not isinstance(ids, list) or not isinstance(plen, int):
            continue
        ans = decode(ids[plen:]).strip()
        while ans.endswith(_EOT):
            ans = ans[:-len(_EOT)].rstrip()
        if 20 <= len(ans) <= 1200:
            pool.append((prompt, ans))
    rng.shuffle(pool)
    out = []
    for prompt, ans in pool[:n]:
        ups = _FOLLOW_UPS[prompt_kind(prompt)]
        if len(re.findall(r"(?m)^\s*(?:\d+[.)]|[-*•])\s", ans)) < 2:  # "the second point" needs points
            ups = tuple(u for u in ups if "second point" not in u)
        out.append(({"role": "user", "content": prompt}, {"role": "assistant", "content": ans},
                    {"role": "user", "content": rng.choice(ups)}))
    return out


def prompt_key(item: str | tuple[dict, ...]) -> str:
    """The string an item is stored and deduped under: the prompt itself, or the JSON of its message tuple."""
    return item if isinstance(item, str) else json.dumps(list(item), ensure_ascii=False, sort_keys=True)


_SHARES = {"package_code": 0.35, "doc_paragraphs": 0.20, "math_v2": 0.15, "explain": 0.12, "math_v1": 0.07,
           "rewrite": 0.05, "templates": 0.06}
_SLACK = 1000  # the new pool is sized for a 6000-prompt first part less this, so it never depends on that part's size


def scaled_prompts(n: int = 30000, seed: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """n deduped prompts: `varied_prompts(6000, 0)` first (in its order), then `extra`, then a pool shuffled with
    rng(seed) of package code ~35%, doc paragraphs ~20%, math v2 ~15% and the older list/explain, math, rewrite and
    template builders with other seeds (~30%; math v2 and explanations top up any shortfall). Nothing after the
    first part equals or contains a held-out prompt (case/space-insensitive).

    The pool's size and content depend only on n, seed and `extra`, not on the first part, whose exact size varies
    a little with the interpreter's state (the stdlib builder's signatures, e.g. with torch imported); the stdlib
    builder itself is left out of the pool for that reason."""
    t0 = time.perf_counter()
    held = [_key(p) for _, p in HELD_OUT_PROMPTS]
    with _gc_paused():
        base = varied_prompts(6000, seed=0)
    seen = {_key(p) for p in base}

    def take(items: Iterable[str], quota: int, name: str, into: list[tuple[str, str]]) -> None:
        got = 0
        for p in items:
            if got >= quota:
                break
            k = _key(p)
            if k in seen or len(p) > _MAX_PROMPT or any(h in k for h in held):
                continue
            seen.add(k)
            into.append((name, p))
            got += 1

    head: list[tuple[str, str]] = []
    take(extra, len(extra), "extra", head)
    size = max(0, n - 6000 - len(extra) + _SLACK)
    q = {k: int(v * size) for k, v in _SHARES.items()}
    pool: list[tuple[str, str]] = []
    take(package_code_prompts(random.Random(seed + 101), q["package_code"]), q["package_code"], "package_code", pool)
    take(doc_paragraph_prompts(random.Random(seed + 102), q["doc_paragraphs"]), q["doc_paragraphs"],
         "doc_paragraphs", pool)
    take(math_prompts_v2(random.Random(seed + 103), 2 * q["math_v2"]), q["math_v2"], "math_v2", pool)
    take(list_and_explain_prompts(random.Random(seed + 104), 2 * q["explain"]), q["explain"], "explain", pool)
    take(math_prompts(random.Random(seed + 105), 2 * q["math_v1"]), q["math_v1"], "math_v1", pool)
    # 1200: the sentence pool varied_prompts already scanned (a larger n makes the old scan walk much further)
    take(rewrite_prompts(random.Random(seed + 107), 1200), q["rewrite"], "rewrite", pool)
    for s in range(seed + 108, seed + 112):
        take(training_prompts(s), q["templates"] - sum(name == "templates" for name, _ in pool), "templates", pool)
    for s in range(seed + 200, seed + 240):  # top up whatever a source could not fill
        if len(pool) >= size:
            break
        take(math_prompts_v2(random.Random(s), size - len(pool)), (size - len(pool) + 1) // 2, "math_v2", pool)
        take(list_and_explain_prompts(random.Random(s), size - len(pool)), size - len(pool), "explain", pool)
    random.Random(seed).shuffle(pool)
    tagged = [("varied_prompts", p) for p in base] + head + pool
    out = [p for _, p in tagged[:n]]
    counts: dict[str, int] = {}
    for name, _ in tagged[:n]:
        counts[name] = counts.get(name, 0) + 1
    log.info("scaled_prompts: %d prompts in %.1f s; per source %s", len(out), time.perf_counter() - t0, counts)
    return out
