"""End to end on the real runtime backend (dspark_trt.runtime.backend.SpecBackend): lossless greedy on the tiny
pair and on the default target, the engine API, and `dspark-trt generate --json`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.spec_decode.loop import LoopConfig, generate
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import CostTable, PolicyConfig


@pytest.fixture(scope="module")
def tiny_runtime(tiny_pair):  # noqa: ANN001, ANN201
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint

    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    drafters = {name: load_drafter(getattr(tiny_pair, name), target, dtype=torch.float32,
                                   target_dir=tiny_pair.target) for name in ("draft", "draft_small")}
    return target, drafters


def _backend(target, drafter, max_batch: int = 4, max_seq: int = 256):  # noqa: ANN001, ANN202
    return SpecBackend(target, drafter, max_batch=max_batch, max_seq=max_seq)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(4, 511), min_size=1, max_size=16),
       policy=st.sampled_from(["fixed", "confidence", "survival"]), k=st.integers(1, 7), gamma=st.integers(1, 7),
       draft=st.sampled_from(["draft", "draft_small"]), n=st.integers(1, 32))
def test_runtime_speculative_greedy_equals_plain_greedy(tiny_runtime, greedy_oracle, tiny_models, prompt, policy,
                                                        k, gamma, draft, n) -> None:
    target, drafters = tiny_runtime
    pol = PolicyConfig(policy=policy, k=k, min_k=1, max_k=k)
    spec = generate(_backend(target, drafters[draft]), prompt, n, policy=pol, config=LoopConfig(gamma=gamma))
    plain = generate(_backend(target, None), prompt, n, policy=PolicyConfig(policy="plain"))
    assert spec.tokens == plain.tokens
    assert plain.tokens == greedy_oracle(tiny_models["target"], prompt, n)  # runtime plain == HF greedy


def test_engine_generate_matches_hf_greedy_and_reports_stats(tiny_pair, tiny_models) -> None:
    from transformers import AutoTokenizer

    from dspark_trt.engine import SpeculativeDecodingEngine

    tok = AutoTokenizer.from_pretrained(tiny_pair.tokenizer)
    # A given cost table, used as given: the engine would otherwise profile step and draft times (and refit them
    # from its timed rounds), and whether the survival gate drafts (what the stats below count) would depend on how
    # loaded the machine is while this test runs.
    eng = SpeculativeDecodingEngine(target_model=tiny_models["target"], draft_model=tiny_models["draft"],
                                    tokenizer=tok, max_length=128, draft_length=5, temperature=0.8, top_p=0.95,
                                    cost_table=CostTable.linear(), calibrate=False)
    ids = tok.encode("def main():\n    return", return_tensors="pt").to(eng.device)
    out = eng.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    ref = tiny_models["target"].generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.eos_token_id)
    assert out.tolist() == ref.tolist()
    s = eng.stats
    assert {"total_tokens", "target_calls", "draft_calls", "accepted_tokens", "drafted_tokens", "speedup"} <= set(s)
    assert s["total_tokens"] == out.shape[1] - ids.shape[1]
    assert s["target_calls"] < s["total_tokens"] and s["accepted_tokens"] > 0 and s["speedup"] > 0
    assert s["calibration"] is None and eng.calibration is None  # calibrate=False: nothing refitted
    # fixed K: the survival gate has learnt from the greedy request that this tiny drafter (a pass costs ~5 steps)
    # does not pay, and it carries that across the engine's requests
    sampled = eng.with_policy(policy="fixed").generate(input_ids=ids, max_new_tokens=20, do_sample=True, seed=3)
    assert sampled.shape[1] <= ids.shape[1] + 20 and sampled[0, :ids.shape[1]].tolist() == ids[0].tolist()
    assert eng.stats["drafted_tokens"] > 0


def test_generate_cli_json(tiny_pair, capsys) -> None:
    from dspark_trt.cli import main

    rc = main(["generate", "--prompt", "import os\nimport", "--max-new-tokens", "24", "--policy", "confidence",
               "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
               "--gamma", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "token_ids", "stats"}
    st_ = out["stats"]
    assert {"target_calls", "draft_calls", "accepted_tokens", "drafted_tokens", "tau", "rounds"} <= set(st_)
    assert all(set(r) == {"k", "accepted", "conf", "proposer"} for r in st_["rounds"])
    assert st_["calibration"]["rounds"] >= 1  # the rounds were timed into the engine's calibrated cost table
    assert 0 < len(out["token_ids"]) <= 24
    rc = main(["generate", "--prompt", "import os\nimport", "--max-new-tokens", "24", "--policy", "plain",
               "--target", str(tiny_pair.target), "--dtype", "float32", "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert plain["token_ids"] == out["token_ids"] and plain["stats"]["tau"] == 1.0
    prompt = "a b c d a b c d a b c d a b c"  # repeats: the suffix proposer has matches from the first round
    for proposers in ("suffix", "dspark,suffix"):
        rc = main(["generate", "--prompt", prompt, "--max-new-tokens", "24", "--proposers", proposers,
                   "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
                   "--gamma", "4", "--json"])
        got = json.loads(capsys.readouterr().out)
        assert rc == 0 and set(got["stats"]["proposers"]) <= set(proposers.split(","))
        assert "suffix" in got["stats"]["proposers"] and {r["proposer"] for r in got["stats"]["rounds"]} >= {"suffix"}
        if proposers == "suffix":
            assert got["stats"]["draft_calls"] == 0
        sfx = got["stats"]["proposers"]["suffix"]  # offered ≥ verified ≥ accepted, α_j per position
        assert sfx["proposed_tokens"] >= sfx["drafted_tokens"] >= sfx["accepted_tokens"] > 0
        assert 0 < len(sfx["acceptance_per_position"]) <= 4
        rc = main(["generate", "--prompt", prompt, "--max-new-tokens", "24", "--policy", "plain",
                   "--target", str(tiny_pair.target), "--dtype", "float32", "--json"])
        assert json.loads(capsys.readouterr().out)["token_ids"] == got["token_ids"]


def test_deployment_guide_example_runs(tiny_pair) -> None:
    """The deployment guide's example, verbatim shape: HF objects in bf16, sampling, decode, stats."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_trt.engine import SpeculativeDecodingEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    target_model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, torch_dtype=torch.bfloat16)
    draft_model = AutoModelForCausalLM.from_pretrained(tiny_pair.draft, torch_dtype=torch.bfloat16)
    engine = SpeculativeDecodingEngine(target_model=target_model, draft_model=draft_model, tokenizer=tokenizer,
                                       max_length=512, draft_length=5, temperature=0.8, top_p=0.95)
    input_ids = tokenizer.encode("def quicksort(xs):", return_tensors="pt").to(engine.device)
    with torch.no_grad():
        output_ids = engine.generate(input_ids=input_ids, max_new_tokens=64, do_sample=True)
    text = tokenizer.decode(output_ids[0], skip_special_tokens=True)
    assert text.startswith("def quicksort(xs):")
    stats = engine.stats
    assert stats.get("total_tokens") == output_ids.shape[1] - input_ids.shape[1]
    assert stats.get("target_calls") <= stats.get("total_tokens") and stats.get("draft_calls") > 0
    assert isinstance(stats.get("speedup"), float)


def _default_drafter(target, target_dir: Path):  # noqa: ANN001, ANN202
    """The shipped DSpark drafter; until it lands, a noisy copy of the target as an LM drafter (γ = 4)."""
    from dspark_trt.errors import DrafterError
    from dspark_trt.runtime.drafters import LMDrafter, default_drafter_dir, load_drafter
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint

    try:
        return load_drafter(default_drafter_dir(), target, dtype=torch.bfloat16, target_dir=target_dir)
    except DrafterError:
        copy = load_hf_checkpoint(target_dir, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in copy.parameters():
                if p.dim() == 2:
                    p.add_((torch.randn(p.shape, generator=g) * p.float().std() * 0.05).to(p.dtype))
        return LMDrafter(copy, gamma=4)


@pytest.mark.slow
def test_default_target_lossless(default_target_dir: Path) -> None:
    """SmolLM2-135M + drafter: speculative greedy == plain greedy, every policy.

    The target runs in float32: in bfloat16 the verify pass over K+1 tokens and a 1-token decode step round
    differently, so exact logit ties (common with bf16 logits) can break the other way ("The capital of France
    is", token 24) — a runtime numerics property, not the loop's; see docs/benchmarks-avx512-amx.md."""
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer

    target = load_hf_checkpoint(default_target_dir, dtype=torch.float32)
    drafter = _default_drafter(target, default_target_dir)
    tok = load_tokenizer(default_target_dir)
    prompts = ["def fibonacci(n):", "The capital of France is", "Q: What is 12 * 7?\nA:"]
    accepted = 0
    for text, pol in zip(prompts, ["fixed", "confidence", "survival"]):
        ids = tok.encode(text)
        spec = generate(_backend(target, drafter, 1, 256), ids, 24, policy=PolicyConfig(policy=pol, k=4, max_k=4),
                        config=LoopConfig(gamma=int(drafter.gamma)))
        plain = generate(_backend(target, None, 1, 256), ids, 24, policy=PolicyConfig(policy="plain"))
        assert spec.tokens == plain.tokens, text
        accepted += spec.stats.accepted_tokens
    assert accepted > 0


def test_generate_cli_from_a_build(tiny_pair, tmp_path, capsys, caplog) -> None:
    """`generate --build-dir` runs the exported TRT-LLM checkpoints of a build; same tokens as the HF dirs.
    The old spelling --engine-dir still works and logs a deprecation warning."""
    from dspark_trt.cli import main

    out_dir = tmp_path / "build"
    assert main(["build", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
                 "--output", str(out_dir), "--calib-samples", "4", "--calib-seq-len", "64", "--eval-tokens", "128",
                 "--max-seq-len", "256", "--max-draft-len", "4", "--no-bench"]) == 0
    capsys.readouterr()
    args = ["generate", "--prompt", "class A:", "--max-new-tokens", "16", "--json", "--policy", "fixed", "--k", "3"]
    assert main(args + ["--build-dir", str(out_dir)]) == 0
    built = json.loads(capsys.readouterr().out)
    assert main(args + ["--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert built["token_ids"] == direct["token_ids"] and built["stats"]["drafted_tokens"] > 0
    assert "deprecated" not in caplog.text
    assert main(args + ["--engine-dir", str(out_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == built["token_ids"]
    assert "--engine-dir is deprecated; use --build-dir" in caplog.text


def test_bench_writes_a_report(tiny_pair, tmp_path, capsys, caplog) -> None:
    """Every fixed K in 1..γ, confidence, survival and survival with a useless drafter, one prompts file, a plot."""
    from dspark_trt.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def main(argv):", "chat": false, "kind": "code"}\n'
                       '{"prompt": "Tell me a story.", "kind": "chat"}\n')
    out = tmp_path / "bench.md"
    assert main(["bench", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
                 "--max-new-tokens", "6", "--repeats", "1", "--prompts", str(prompts), "--no-hf",
                 "--out", str(out)]) == 0
    text = out.read_text()
    main_rows = [line for line in text.split("Acceptance per position")[0].splitlines() if line.startswith("| ours")]
    gamma = 4  # the tiny LM drafter's default block (--max-draft-len of the e2e build)
    names = [r.split("|")[1].strip() for r in main_rows]
    assert names[0] == "ours plain" and "ours DSpark (confidence)" in names and "ours DSpark (survival)" in names
    assert "ours DSpark (survival, useless drafter)" in names
    assert {"ours suffix (survival)", "ours hybrid DSpark+suffix (survival)",
            "ours hybrid DSpark+suffix (survival, useless drafter)"} <= set(names)  # both proposers, each alone
    assert "| engine | proposer | rounds | accepted tokens | α | α_j |" in text
    fixed = [n for n in names if n.startswith("ours DSpark (fixed K=")]
    assert len(fixed) >= gamma - 1, names  # every K in 1..γ
    assert all(r.rstrip().endswith("| yes |") for r in main_rows[1:]), text  # lossless, the useless drafter too
    assert "τ by prompt kind" in text and "| engine | chat | code |" in text and "commit " in text
    assert out.with_suffix(".png").stat().st_size > 10_000
    from dspark_trt.commands.bench import prompt_set

    edits = prompt_set("code-edit")
    assert len(edits) >= 6 and {p.kind for p in edits} == {"code-edit"} and all("```" in p.text for p in edits)
    assert {p.kind for p in prompt_set("all")} >= {"code", "chat", "math", "code-edit", "text"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert main(["bench", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--prompts", str(bad),
                 "--no-hf", "--out", str(out)]) != 0
    assert 'must be a JSON object with "prompt"' in caplog.text

def test_bench_stop_at_eos_measures_answers_as_requests_end(tiny_pair, tmp_path) -> None:
    """--stop-at-eos: the runs keep the target's EOS, so an answer that ends early is measured over its own tokens
    (the report states plain's answer lengths); without it every run decodes --max-new-tokens past EOS."""
    from dspark_trt.cli import main

    prompts = tmp_path / "p.jsonl"  # the tiny target ends "a b c" with EOS at its 39th token
    prompts.write_text('{"prompt": "a b c", "chat": false, "kind": "text"}\n')

    def report(*flags: str) -> str:
        out = tmp_path / f"bench{len(flags)}.md"
        assert main(["bench", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype",
                     "float32", "--max-new-tokens", "48", "--repeats", "1", "--prompts", str(prompts), "--no-hf",
                     "--policies", "survival", "--fixed-k", "2", "--no-suffix", "--out", str(out), *flags]) == 0
        return out.read_text()

    eos = report("--stop-at-eos")
    assert "answers end at EOS as requests do (at most 48 new tokens; plain's answers 39.0 tokens on average, 39–39" \
        in eos and "--stop-at-eos`" in eos
    rows = [line for line in eos.split("Acceptance per position")[0].splitlines() if line.startswith("| ours")]
    assert rows and all(r.rstrip().endswith("| yes |") for r in rows[1:])  # lossless at the answer's own end
    assert "EOS ignored, 48 new tokens per run" in report()


def test_bench_hf_row_runs_in_the_dtype_its_products_are_fast_in(tiny_pair, tmp_path) -> None:
    """The Hugging Face baseline row: bf16 where bf16 matrix products are fast, else fp32 and labelled so (a CPU
    without AVX512_BF16 / AMX runs torch's bf16 GEMM ~100x slower); ours are compared with it in the vs-HF column."""
    from dspark_trt.cli import main
    from dspark_trt.runtime.ops import bf16_matmul_fast

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def main(argv):", "chat": false, "kind": "code"}\n')
    out = tmp_path / "bench.md"
    assert main(["bench", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
                 "--max-new-tokens", "6", "--repeats", "1", "--prompts", str(prompts), "--policies", "survival",
                 "--no-useless-drafter", "--no-suffix", "--out", str(out)]) == 0
    text = out.read_text()
    label = "HF generate (bf16)" if bf16_matmul_fast() else "HF generate (fp32: bf16 products are slow on this CPU)"
    assert f"| {label} |" in text, text
    plain = next(line for line in text.splitlines() if line.startswith("| ours plain |"))
    assert plain.split("|")[4].strip().endswith("×"), plain  # vs HF: a ratio, not "–"


def test_bench_sampled_rows_keep_plain_samplings_tokens_with_the_suffix_match(tiny_pair, tmp_path) -> None:
    """--temperature: every engine samples prompt i with seed --seed + i; the suffix row (its rounds coupled to the
    target's sampler) commits plain sampling's tokens in every run."""
    from dspark_trt.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c d a b c d a b c d a b", "chat": false, "kind": "text"}\n'
                       '{"prompt": "def main(argv):", "chat": false, "kind": "code"}\n')
    out = tmp_path / "bench.md"
    assert main(["bench", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
                 "--max-new-tokens", "12", "--repeats", "1", "--prompts", str(prompts), "--policies", "survival",
                 "--no-useless-drafter", "--temperature", "0.9", "--seed", "5", "--out", str(out)]) == 0
    text = out.read_text()
    assert "sampled at temperature 0.9" in text and "--temperature 0.9 --seed 5" in text
    assert "output = plain sampling (same seed) |" in text and "HF generate" not in text
    row = next(line for line in text.splitlines() if line.startswith("| ours suffix (survival) |"))
    assert row.rstrip().endswith("| yes |"), text


@pytest.mark.slow
def test_default_target_gets_the_shipped_corpus_and_stays_lossless(default_target_dir: Path) -> None:
    """corpus="auto": the embedded default target (same embedding fingerprint) gets the shipped corpus of its own
    answers, a proposal source on prompts it never saw; the output equals plain greedy."""
    from dspark_trt.engine import SpeculativeDecodingEngine
    from dspark_trt.runtime.drafters.vocab import target_fingerprint
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer

    target = load_hf_checkpoint(default_target_dir, dtype=torch.float32)
    tok = load_tokenizer(default_target_dir)
    eng = SpeculativeDecodingEngine(target, None, tok, max_length=256, policy="survival", proposers="suffix")
    assert eng.corpus is not None and eng.corpus.size > 5_000_000
    assert eng.corpus.meta["target_fingerprint"] == target_fingerprint(target.embed_tokens.weight)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Give me three tips for a job interview."}],
                                             add_generation_prompt=True, tokenize=False))
    res = eng.run(ids, 48)
    plain = generate(_backend(target, None, 1, 256), ids, 48, policy=PolicyConfig(policy="plain"))
    assert res.tokens == plain.tokens
    assert res.stats.by_proposer["suffix"].accepted_tokens >= 10  # its own tokens alone give 4 here
    none = SpeculativeDecodingEngine(target, None, tok, max_length=256, policy="survival", proposers="suffix",
                                     corpus=None)
    assert none.corpus is None and none.run(ids, 48).tokens == plain.tokens
