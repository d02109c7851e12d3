"""The build pipeline: stages in order, each with a tqdm bar, timings, and a manifest record.

Stages: validate → quantize (ModelOpt, in memory) → export (TRT-LLM checkpoints + tokenizer) → verify
(the reference runtime runs the exported files: quality vs the unquantized Hugging Face model, decode
speed) → engines (trtllm.py) → model_repo (model_repo/ and/or model_repo_trtllm/ per --serving).
quantize+export are skipped together when the export key (hash of input checkpoint files, calibration text
and every flag that shapes the checkpoint) matches the manifest and the outputs exist; later stages chain
their keys on the earlier ones. Must not import tensorrt_llm (only trtllm.py does).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from dspark_trt.builder import calib as calib_mod
from dspark_trt.builder.manifest import Manifest, StageRecord, hash_dir, hash_file, hash_json, package_versions
from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.validate import ValidatedPair, validate
from dspark_trt.errors import BuildError, InvalidArgumentError

log = logging.getLogger(__name__)

EXPORT_VERSION = 3  # bump when the export format changes (invalidates old builds)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class _Stage:
    """Context: a tqdm bar + timing for one stage."""

    def __init__(self, name: str, total: int, quiet: bool) -> None:
        self.name, self.t0 = name, time.perf_counter()
        self.bar = tqdm(total=total, desc=f"{name:<10}", unit="step", disable=quiet, leave=True)

    def step(self, n: int = 1, note: str | None = None) -> None:
        if note:
            self.bar.set_postfix_str(note)
        self.bar.update(n)

    def close(self) -> float:
        self.bar.close()
        return round(time.perf_counter() - self.t0, 3)


class BuildPipeline:
    """Runs `dspark-trt build` with one set of BuildOptions into build_dir."""

    def __init__(self, opts: BuildOptions, quiet: bool = False) -> None:
        self.opts = opts
        self.out = Path(opts.output).expanduser().resolve()
        self.quiet = quiet
        self.manifest = Manifest(self.out)

    # ------------------------------------------------------------------ helpers
    def _skip(self, name: str, key: str) -> bool:
        if self.manifest.up_to_date(name, key):
            log.info("stage %s unchanged (key %s): skipped", name, key)
            self.manifest.mark_skipped(name, True)
            return True
        return False

    def _record(self, name: str, key: str, outputs: dict[str, Any], seconds: float) -> None:
        self.manifest.record(name, StageRecord(key=key, outputs=outputs, seconds=seconds, finished_at=_now()))
        self.manifest.save()

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        opts = self.opts
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        st = _Stage("validate", 1, self.quiet)
        pair = validate(opts, self.out)
        inputs = {"target": {"path": str(pair.target), "files": hash_dir(pair.target)},
                  "draft": {"path": str(pair.draft), "kind": pair.draft_kind, "files": hash_dir(pair.draft)}}
        st.step(1)
        check_serving(opts, pair.draft_kind)
        self.manifest.set("options", opts.to_dict())
        self.manifest.set("inputs", inputs)
        self.manifest.set("packages", package_versions())
        self._record("validate", hash_json(inputs), {"target_arch": pair.target_arch, "draft_kind": pair.draft_kind,
                                                      "draft_arch": pair.draft_arch, "input_bytes": pair.input_bytes},
                     st.close())

        corpus = check_corpus(opts, pair)  # a corpus file of another vocabulary fails here, before any stage
        export_key = hash_json({"v": EXPORT_VERSION, "inputs": inputs, "calib": [hash_file(calib_mod.CALIB_DIR / n) for n in
                                ("calib.txt", "heldout.txt")], "modelopt": self.manifest.data["packages"].get("nvidia-modelopt"),
                                "corpus": [opts.corpus, hash_file(corpus) if corpus is not None else None],
                                **{k: getattr(opts, k) for k in ("dtype", "quant", "kv_quant", "tp_size", "calib_samples",
                                                                 "calib_seq_len", "eval_tokens")}})
        if not (self._skip("quantize", export_key) and self._skip("export", export_key)):
            self._quantize_and_export(pair, export_key)
        verify_key = hash_json({"export": export_key, "v": EXPORT_VERSION})
        if not self._skip("verify", verify_key):
            self._verify(pair, verify_key)
        engines_key = hash_json({"export": export_key, **{k: getattr(opts, k) for k in (
            "max_draft_len", "max_batch_size", "max_seq_len", "build_engines", "cost_table", "policy", "min_k",
            "max_k")}})
        if not self._skip("engines", engines_key):
            self._engines(pair, engines_key)
        from dspark_trt.builder.model_repo import template_hashes, template_values

        repo_key = hash_json({"templates": template_hashes(hash_file), "values": template_values(opts, self.out),
                              "serving": opts.serving, "draft_kind": pair.draft_kind})
        if not self._skip("model_repo", repo_key):
            st = _Stage("model_repo", 1, self.quiet)
            facts = self._model_repos(pair)
            st.step(1)
            self._record("model_repo", repo_key, facts, st.close())
        self.manifest.set("total_seconds", round(time.perf_counter() - t0, 3))
        self.manifest.set("quality", {k: self.manifest.data["stages"].get(s, {}).get("outputs", {}).get(k)
                                      for s, k in (("verify", "target"), ("verify", "draft"),
                                                   ("quantize", "target_fake_quant"), ("quantize", "draft_fake_quant"))})
        self.manifest.save()
        log.info("build finished in %.1f s: %s", time.perf_counter() - t0, self.out)
        return self.manifest.data

    # ------------------------------------------------------------------ stages
    def _quantize_and_export(self, pair: ValidatedPair, key: str) -> None:
        from transformers import AutoTokenizer

        from dspark_trt.builder import export as ex
        from dspark_trt.builder import quantize as qz

        opts = self.opts
        tok = AutoTokenizer.from_pretrained(str(pair.target))
        calib = calib_mod.calibration_batches(tok, opts.calib_samples, opts.calib_seq_len)  # [N, T]
        held = calib_mod.heldout_tokens(tok, opts.eval_tokens)  # [M, 128]
        quantizing = opts.quant != "none" or opts.kv_quant != "none"
        extra = {"modelopt": package_versions(("nvidia-modelopt",))["nvidia-modelopt"],
                 "trtllm_pins_modelopt": ex.TRTLLM_PINNED_MODELOPT,
                 "version_catch": ex.VERSION_CATCH.format(mo=package_versions(("nvidia-modelopt",))["nvidia-modelopt"])}
        st = _Stage("quantize", 2 * calib.shape[0] if quantizing else 2, self.quiet)
        models: dict[str, Any] = {}
        qfacts: dict[str, Any] = {"recipe": qz.modelopt_config(opts.quant, opts.kv_quant) if quantizing else None,
                                  "calibration": {"sequences": int(calib.shape[0]), "tokens_each": int(calib.shape[1])}}
        for role, path, arch in (("target", pair.target, pair.target_arch), ("draft", pair.draft, pair.draft_arch)):
            if role == "draft" and pair.draft_kind == "dspark":
                models[role] = self._quantize_dspark(pair, calib, st, qfacts) if quantizing else None
                if not quantizing:
                    st.step(1)
                continue
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            if quantizing:
                ref = qz.logits_hf(m, held)
                qz.quantize_hf(m, opts.quant, opts.kv_quant if role == "target" else "none", calib,
                               progress=lambda n: st.step(n, role))
                qfacts[f"{role}_fake_quant"] = qz.quality(ref, qz.logits_hf(m, held), held)
                qfacts[f"{role}_quantizers"] = qz.quantizer_summary(m)
            else:
                st.step(1, role)
            models[role] = m
        self._record("quantize", key, qfacts, st.close())

        st = _Stage("export", 3, self.quiet)
        efacts: dict[str, Any] = {"paths": ["target/checkpoint", "draft/checkpoint", "tokenizer"]}
        for role, path, arch in (("target", pair.target, pair.target_arch), ("draft", pair.draft, pair.draft_arch)):
            out = self.out / role / "checkpoint"
            if out.exists():
                shutil.rmtree(out)
            if role == "draft" and pair.draft_kind == "dspark":
                from dspark_trt.runtime.drafters import load_dspark_model

                model = models[role] if models[role] is not None else load_dspark_model(path, dtype=torch.float32)
                cfg = ex.export_dspark(model, out, opts, quantized=models[role] is not None, extra=extra)
            elif opts.dtype == "float32" and not quantizing:
                cfg = ex.write_unquantized(path, arch, out, opts, extra)
            else:
                lm_opts = opts if role == "target" else opts.replace(kv_quant="none")
                cfg = ex.export_modelopt(models[role], arch, path, out, lm_opts, extra)
            efacts[role] = {"architecture": cfg["architecture"], "dtype": cfg["dtype"],
                            "quantization": cfg.get("quantization"), "tp_size": cfg["mapping"]["tp_size"],
                            "files": hash_dir(out), "writer": (cfg.get("producer") or {}).get("name")}
            st.step(1, role)
        tdir = self.out / "tokenizer"
        tdir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (pair.target / name).is_file():
                shutil.copy2(pair.target / name, tdir / name)
        st.step(1, "tokenizer")
        efacts["corpus"] = self._corpus(models["target"])
        efacts["version_catch"] = extra["version_catch"]
        self._record("export", key, efacts, st.close())

    def _corpus(self, target: Any) -> dict[str, Any] | None:
        """Copy the suffix corpus (spec_decode.corpus) into the build as corpus.npz (--corpus: auto / none / FILE)
        → its meta, or None (no corpus: the served suffix proposer uses the request's tokens and recent outputs)."""
        from dspark_trt.runtime.default_model import corpus_for, default_corpus_file
        from dspark_trt.spec_decode.corpus import corpus_meta

        dest = self.out / "corpus.npz"
        dest.unlink(missing_ok=True)
        emb = target.get_input_embeddings().weight  # [V, d]: its fingerprint says whether "auto" applies
        index = corpus_for(self.opts.corpus, emb, int(emb.shape[0]))
        if index is None:
            return None
        src = default_corpus_file() if self.opts.corpus == "auto" else Path(self.opts.corpus)
        shutil.copy2(src, dest)
        meta = corpus_meta(dest)
        return {"path": "corpus.npz", "positions": index.size, **{k: meta.get(k) for k in
                                                                   ("answer_tokens", "records", "target_fingerprint")}}

    def _quantize_dspark(self, pair: ValidatedPair, calib: torch.Tensor, st: _Stage, facts: dict[str, Any]) -> Any:
        """ModelOpt-quantize the DSpark drafter, calibrated on real target features of the calibration text."""
        from dspark_trt.builder.quantize import quantize_dspark, quantizer_summary
        from dspark_trt.runtime.drafters import DSparkDrafter, load_dspark_model
        from dspark_trt.runtime.hf_loader import load_hf_checkpoint

        target = load_hf_checkpoint(pair.target, dtype=torch.float32)
        model = load_dspark_model(pair.draft, dtype=torch.float32)
        model.attach_target(target.embed_tokens.weight, target.lm_head_weight)
        taps = tuple(model.cfg.target_layer_ids)
        gamma = model.cfg.block_size
        from dspark_trt.spec_decode.protocols import SamplingParams

        def loop(m: torch.nn.Module) -> None:
            drafter = DSparkDrafter(m)
            for i in range(calib.shape[0]):
                seq = calib[i:i + 1]  # [1, T]
                T = seq.shape[1]
                cache = target.new_cache(1, T)
                feats = target(seq, cache, [0], taps=taps, logits="none").hidden  # [1, T, F]
                drafter.allocate(1, T + gamma + 1)
                step = max(8, T // 8)
                for a in range(0, T - 1, step):
                    b = min(a + step, T - 1)
                    drafter.extend_context(torch.tensor([0]), seq[:, a:b], torch.tensor([b - a]), feats[:, a:b])
                    drafter.propose(torch.tensor([0]), seq[:, b], gamma, [SamplingParams()])
                st.step(1, "draft")

        quantize_dspark(model, self.opts.quant, self.opts.kv_quant, loop)
        facts["draft_quantizers"] = quantizer_summary(model)
        return model

    def _verify(self, pair: ValidatedPair, key: str) -> None:
        from dspark_trt.builder.verify import verify_build

        st = _Stage("verify", 2, self.quiet)
        facts = verify_build(self.out, self.opts, pair, progress=lambda note: st.step(1, note))
        self._record("verify", key, facts, st.close())

    def _model_repos(self, pair: ValidatedPair) -> dict[str, Any]:
        """model_repo/ and/or model_repo_trtllm/ per --serving; manifest facts (values, paths, each repo's files)."""
        from dspark_trt.builder.model_repo import fill_model_repo, fill_trtllm_repo

        opts = self.opts
        repos: dict[str, Any] = {}
        if opts.serves_reference:
            repos["model_repo"] = fill_model_repo(opts, self.out)
        if opts.serves_trtllm:  # DSpark: no draft engine; the target is the tapped target (its outputs declared)
            repos["model_repo_trtllm"] = fill_trtllm_repo(opts, self.out, draft_engine=pair.draft_kind != "dspark",
                                                          taps=drafter_taps(pair))
        facts: dict[str, Any] = dict(repos.get("model_repo") or next(iter(repos.values())))
        facts.update(serving=opts.serving, paths=list(repos), repositories={k: v["filled"] for k, v in repos.items()})
        return facts

    def _engines(self, pair: ValidatedPair, key: str) -> None:
        from dspark_trt.builder import trtllm

        st = _Stage("engines", 1, self.quiet)
        tq = (self.manifest.stage("export").outputs.get("target") or {}).get("quantization") or {}
        dq = (self.manifest.stage("export").outputs.get("draft") or {}).get("quantization") or {}
        engines = self.out / "engines"
        if engines.exists():
            shutil.rmtree(engines)
        taps = drafter_taps(pair)
        facts = trtllm.build_engines(engines, self.opts, self.out / "target" / "checkpoint",
                                     self.out / "draft" / "checkpoint", pair.draft_kind, tq.get("quant_algo"),
                                     dq.get("quant_algo"), taps)
        facts["paths"] = ["engines"]
        if pair.draft_kind == "dspark":
            from dspark_trt.builder.llmapi import write_llmapi

            facts["llmapi"] = write_llmapi(engines / "llmapi", self.opts, self.out, pair.draft)
            facts["paths"].append("engines/llmapi")
        st.step(1, "built" if facts.get("built") else "plan only")
        self._record("engines", key, facts, st.close())


def check_corpus(opts: BuildOptions, pair: ValidatedPair) -> Path | None:
    """The corpus file --corpus names (auto: the shipped one, used only if it matches the target; none: None) →
    its path; InvalidArgumentError naming the fix if a named file is missing or made for another vocabulary."""
    import json

    from dspark_trt.runtime.default_model import default_corpus_file
    from dspark_trt.spec_decode.corpus import corpus_meta

    if opts.corpus == "none":
        return None
    if opts.corpus == "auto":
        path = default_corpus_file()
        return path if path.is_file() else None
    path = Path(opts.corpus)
    size = int(corpus_meta(path).get("vocab_size", 0))
    want = int(json.loads((pair.target / "config.json").read_text()).get("vocab_size", 0))
    if size != want:
        raise InvalidArgumentError(f"--corpus {path} was made for a vocabulary of {size} tokens, the target has "
                                   f"{want}; build a corpus from this target's own outputs (scripts/build_corpus.py)")
    return path


def drafter_taps(pair: ValidatedPair) -> tuple[int, ...]:
    """The DSpark drafter's target_layer_ids (from its config.json); () for an LM drafter."""
    if pair.draft_kind != "dspark":
        return ()
    import json

    cfg = json.loads((pair.draft / "config.json").read_text())
    taps = tuple(int(t) for t in cfg.get("target_layer_ids") or ())
    if not taps:
        raise BuildError(f"{pair.draft}/config.json has no target_layer_ids; a DSpark drafter lists the target layers "
                         "it reads. Fix: use a drafter trained by `dspark-trt train-drafter`.")
    return taps


def check_serving(opts: BuildOptions, draft_kind: str) -> None:
    """Every --serving mode takes every drafter kind: LM / PARD drafters get a draft engine, DSpark drafters the
    tapped target (builder/trtllm_taps.py) and the reference drafter in the GPU-host `dspark` model (docs/gpu.md)."""
    if draft_kind not in ("lm", "dspark"):
        raise BuildError(f"unknown drafter kind {draft_kind!r}; pass an LM / PARD or a DSpark --draft checkpoint.")


def run_build(opts: BuildOptions, quiet: bool = False, on_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Build and return the manifest dict."""
    data = BuildPipeline(opts, quiet=quiet).run()
    if on_done:
        on_done(data)
    return data
