"""The native engines (amx, avx512, avx2; runtime/native/__init__.py) against each other and against themselves.

Asserts, for every engine this machine runs: each kernel's rows are the same alone and in any batch (decode ==
verify at the kernel level), and — where two or more engines run — every kernel (products of every packing kind
with each fused epilogue, RoPE + KV write, causal / windowed / bidirectional attention, the greedy Markov block)
gives the same bits on all of them — except amx bf16 products, a different arithmetic (tiles), which agree with the
FMA engines to rounding. The AVX2 engine runs on every x86-64-v3 machine, so its tests run everywhere;
the AVX-512 / AMX ones skip with the reason where the CPU lacks them. Engine choice: DSPARK_NATIVE_ENGINE forces
one, an engine the CPU lacks falls back to the torch path and says why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

import pytest
import torch

from dspark_trt.runtime import native

ENGINES = native.runnable_engines()
pytestmark = pytest.mark.skipif(not ENGINES, reason=f"no native engine runs here ({native.unavailable_reason()})")
TWO = pytest.mark.skipif(len(ENGINES) < 2, reason=f"only {ENGINES or 'no'} engine(s) run on this CPU: nothing to compare")

# (M, N, K): decode, a few rows, a verify block of 9, tails in every dimension, a real layer's shape
SHAPES = [(1, 64, 64), (3, 40, 100), (9, 96, 576), (10, 48, 130), (17, 34, 65), (2, 1536, 576)]
EPILOGUES = ["plain", "scale", "bias", "bias_f32", "residual", "norm", "swiglu", "out_f32", "all"]
KINDS = {  # name → (weight dtype, activation dtype, SmoothQuant)
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "fp32": (torch.float32, torch.float32, False),
    "w8a16_bf16": (torch.int8, torch.bfloat16, False),
    "w8a16_fp32": (torch.int8, torch.float32, False),
    "sq_bf16": (torch.int8, torch.bfloat16, True),
}


def _on_each(fn: Callable[[], object]) -> dict[str, object]:
    out = {}
    for e in ENGINES:
        with native.use_engine(e):
            out[e] = fn()
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) or (a.dtype.is_floating_point and bool(torch.equal(a.isnan(), b.isnan())) and
                                     torch.equal(a.nan_to_num(), b.nan_to_num()))
    return all(_same(x, y) for x, y in zip(a, b))  # type: ignore[call-overload]


def _linear_case(kind: str, shape: tuple[int, int, int], epi: str, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A product of `kind` with epilogue `epi` as a function of its activations x [M, K]; also returns x."""
    wd, xd, sq = KINDS[kind]
    M, N, K = shape
    g = torch.Generator().manual_seed(seed)
    if wd == torch.int8:
        w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    else:
        w = (torch.randn(N, K, generator=g) * 0.05).to(wd)
    kw: dict = {}
    ep = EPILOGUES[:-1] if epi == "all" else [epi]
    if "swiglu" in ep and N % 2:
        ep = [e for e in ep if e != "swiglu"]
    nout = N // 2 if "swiglu" in ep else N
    if wd == torch.int8 or "scale" in ep:
        kw["scale"] = torch.rand(N, generator=g) * 0.01 + 1e-3
    if "bias" in ep or "bias_f32" in ep:
        f32 = "bias_f32" in ep
        kw["bias"] = torch.randn(N, generator=g).to(torch.float32 if f32 else xd)
        kw["bias_f32"] = f32
    if "residual" in ep:
        kw["residual"] = torch.randn(M, nout, generator=g).to(xd)
    if "norm" in ep:
        kw["norm"], kw["eps"] = (torch.rand(K, generator=g) + 0.5).to(xd), 1e-5
    if "swiglu" in ep:
        kw["swiglu"] = True
    if "out_f32" in ep:
        kw["out_f32"] = True
    if sq:
        kw["sq"] = (torch.rand(K, generator=g) + 0.5, 0.05)
    res = kw.get("residual")

    def run(x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        args = dict(kw)
        if res is not None:
            args["residual"] = res[rows].contiguous()
        return native.linear(x, w, None, **args)

    return run  # type: ignore[return-value]


def _activations(shape: tuple[int, int, int], kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    M, _, K = shape
    spread = torch.logspace(-4, 1, K)[torch.randperm(K, generator=g)]  # elements over many binades in one row
    return (torch.randn(M, K, generator=g) * spread).to(KINDS[kind][1])


def _same_arithmetic(kind: str) -> list[str]:
    """The engines that compute `kind` with the same arithmetic: all of them, except that AMX multiplies bf16
    weights by bf16 activations on tiles (TDPBF16PS: pairs of products per step, its own rounding and denormal
    rules) where the AVX-512 and AVX2 engines run fp32 FMA chains — so amx bf16 products are not bitwise those of
    the FMA engines (each engine on its own is row- and batch-invariant, tested below). Integer (W8A16 / SQ) and
    fp32 products are the same sums on every engine."""
    return [e for e in ENGINES if not (e == "amx" and KINDS[kind][0] == torch.bfloat16)]


@TWO
@pytest.mark.parametrize("epi", EPILOGUES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_engines_of_one_arithmetic_agree_bit_for_bit_on_products(kind: str, epi: str) -> None:
    exact = _same_arithmetic(kind)
    if len(exact) < 2:
        pytest.skip(f"only {exact} compute {kind} with FMA chains here: nothing to compare bitwise")
    for i, shape in enumerate(SHAPES):
        run = _linear_case(kind, shape, epi, seed=i)
        x = _activations(shape, kind, seed=i)
        got = _on_each(lambda: run(x))
        ref = got[exact[0]]
        for e in exact[1:]:
            d = (got[e].float() - ref.float()).abs().max()
            assert _same(got[e], ref), f"{kind}/{epi} {shape}: {e} differs from {exact[0]} (max |Δ| {float(d):.3g})"


@pytest.mark.skipif("amx" not in ENGINES or len(ENGINES) < 2, reason=f"needs the amx engine and an FMA engine "
                    f"(this CPU runs {ENGINES or 'none'})")
@pytest.mark.parametrize("epi", EPILOGUES)
def test_amx_bf16_products_differ_from_the_fma_engines_only_by_rounding(epi: str) -> None:
    """The tile arithmetic and the FMA chains agree to fp32 accumulation rounding plus one bf16 output rounding
    (measured worst 5e-4 of the output's scale; bound 2^-7)."""
    fma = [e for e in ENGINES if e != "amx"][0]
    for i, shape in enumerate(SHAPES):
        run = _linear_case("bf16", shape, epi, seed=i)
        x = _activations(shape, "bf16", seed=i)
        got = _on_each(lambda: run(x))
        a, b = got["amx"].float(), got[fma].float()
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 2 ** -7 * scale + 1e-30, f"bf16/{epi} {shape}: amx vs {fma}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_product_rows_are_batch_invariant_on_each_engine(engine: str, kind: str) -> None:
    with native.use_engine(engine):
        for i, shape in enumerate(SHAPES[:5]):
            run = _linear_case(kind, shape, "all", seed=10 + i)
            x = _activations(shape, kind, seed=10 + i)
            full = run(x)  # [M, Nout]
            for m in range(x.shape[0]):
                alone = run(x[m:m + 1].contiguous(), slice(m, m + 1))
                assert _same(alone[0], full[m]), f"{engine} {kind} {shape}: row {m} alone differs from the batch"


def _attention_case(seed: int, dtype: torch.dtype, D: int, H: int, Hkv: int, B: int, T: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    S, max_seq = B + 1, 256
    ck = torch.randn(S, Hkv, max_seq, D, generator=g).to(dtype)
    cv = torch.randn(S, Hkv, max_seq, D, generator=g).to(dtype)
    q = torch.randn(B * T, H * D, generator=g).to(dtype)
    slots = torch.randperm(S, generator=g)[:B]
    starts = torch.randint(0, 200, (B,), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return q, ck, cv, slots, starts, lengths


ATTN = [(16, 4, 4), (32, 8, 1), (64, 9, 3), (128, 4, 2)]


@TWO
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D,H,Hkv", ATTN)
def test_engines_agree_bit_for_bit_on_attention(dtype: torch.dtype, D: int, H: int, Hkv: int) -> None:
    for seed, (B, T, window, bidir) in enumerate([(1, 1, None, False), (3, 9, None, False), (2, 9, 5, False),
                                                  (2, 7, None, True), (1, 9, None, False)]):
        q, ck, cv, slots, starts, lengths = _attention_case(seed, dtype, D, H, Hkv, B, T)
        got = _on_each(lambda: native.attend(q, ck, cv, slots, starts, lengths, H, window, D ** -0.5, bidir))
        for e in ENGINES[1:]:
            assert _same(got[e], got[ENGINES[0]]), f"D={D} B={B} T={T} window={window} bidir={bidir}: {e} differs"


@pytest.mark.parametrize("engine", ENGINES)
def test_attention_of_a_verify_block_equals_its_queries_alone_on_each_engine(engine: str) -> None:
    dtype, D, H, Hkv, T = torch.bfloat16, 64, 9, 3, 9
    q, ck, cv, slots, starts, _ = _attention_case(3, dtype, D, H, Hkv, 1, T)
    with native.use_engine(engine):
        block = native.attend(q, ck, cv, slots, starts, torch.tensor([T]), H, None, D ** -0.5)  # [T, H·D]
        for t in range(T):
            one = native.attend(q[t:t + 1].contiguous(), ck, cv, slots, starts + t, torch.tensor([1]), H, None, D ** -0.5)
            assert torch.equal(one[0], block[t]), f"{engine}: query {t} alone differs from the verify block"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_packed_attention_equals_the_padded_layout_on_each_engine(engine: str, dtype: torch.dtype) -> None:
    """A ragged verify's queries packed (row offsets, Σ lengths rows) attend exactly as in the padded layout: the
    same bits per real query, windows and bidirectional blocks included."""
    D, H, Hkv = 64, 9, 3
    for seed, (B, T, window, bidir) in enumerate([(3, 9, None, False), (4, 8, 5, False), (2, 7, None, True),
                                                  (5, 3, None, False)]):
        q, ck, cv, slots, starts, lengths = _attention_case(seed, dtype, D, H, Hkv, B, T)
        real = (torch.arange(T)[None, :] < lengths[:, None]).reshape(-1).nonzero().squeeze(1)  # [M']
        offsets = torch.cumsum(lengths, 0) - lengths  # [B]
        with native.use_engine(engine):
            padded = native.attend(q, ck, cv, slots, starts, lengths, H, window, D ** -0.5, bidir)  # [B·T, H·D]
            packed = native.attend(q.index_select(0, real).contiguous(), ck, cv, slots, starts, lengths, H, window,
                                   D ** -0.5, bidir, offsets=offsets)  # [M', H·D]
        assert packed.shape == (int(lengths.sum()), H * D)
        assert torch.equal(packed, padded.index_select(0, real)), f"{engine} B={B} T={T} window={window} bidir={bidir}"


@TWO
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [16, 64, 24])
def test_engines_agree_bit_for_bit_on_rope_kv(dtype: torch.dtype, D: int) -> None:
    g = torch.Generator().manual_seed(D)
    H, Hkv, B, T, P = 4, 2, 2, 3, 64
    qkv = torch.randn(B * T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = torch.rand(P, D, generator=g) * 6.3
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    pos = torch.randint(0, P, (B * T,), generator=g)
    slots = torch.tensor([2, 0])

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ck = torch.zeros(3, Hkv, P, D, dtype=dtype)
        cv = torch.zeros(3, Hkv, P, D, dtype=dtype)
        return native.rope_kv(qkv, cos, sin, pos, ck, cv, slots, H, Hkv), ck, cv

    got = _on_each(run)
    for e in ENGINES[1:]:
        assert _same(got[e], got[ENGINES[0]]), f"rope_kv D={D}: {e} differs"


@TWO
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_engines_agree_bit_for_bit_on_the_markov_block(wdtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    B, G, Vd, Vt, r = 3, 7, 300, 500, 48
    u = torch.randn(B, G, Vd, generator=g)
    w1 = (torch.randn(Vt, r, generator=g) * 0.3).to(wdtype)
    w2 = (torch.randn(Vd, r, generator=g) * 0.3).to(wdtype)
    d2t = torch.randint(0, Vt, (Vd,), generator=g)
    anchor = torch.randint(0, Vt, (B,), generator=g)
    got = _on_each(lambda: native.markov_greedy(u, anchor, w1, w2, d2t))
    for e in ENGINES[1:]:
        assert _same(got[e], got[ENGINES[0]]), f"markov_greedy: {e} differs"


def _engine_in_subprocess(env_engine: str) -> dict:
    code = "import json; from dspark_trt.runtime import native; print(json.dumps(native.cpu_summary()))"
    env = dict(os.environ, DSPARK_NATIVE_ENGINE=env_engine)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_environment_forces_an_engine_and_a_missing_one_falls_back_to_torch_with_the_reason() -> None:
    got = _engine_in_subprocess(ENGINES[-1])
    assert got["engine"] == ENGINES[-1] and got["cpu"]
    missing = [e for e in native.ENGINES if e not in ENGINES]
    bogus = _engine_in_subprocess(missing[0] if missing else "sse9")
    assert bogus["engine"] == "torch"
    assert "DSPARK_NATIVE_ENGINE" in bogus["engine_reason"], bogus


def test_the_default_engine_is_the_best_that_runs() -> None:
    assert _engine_in_subprocess("auto")["engine"] == ENGINES[0]
    if os.environ.get("DSPARK_NATIVE_ENGINE", "auto") in ("", "auto") and os.environ.get("DSPARK_NATIVE", "1") != "0":
        assert native.engine() == ENGINES[0]


@pytest.mark.skipif("avx512" not in ENGINES or "avx512_bf16" not in native.cpu_flags(),
                    reason="needs the avx512 engine on a CPU with AVX512_BF16 (Zen 4 / Zen 5 / Sapphire Rapids)")
def test_avx512_engine_runs_bf16_products_on_vdpbf16ps_with_the_fma_chains_bits() -> None:
    """Where the CPU has AVX512_BF16 the avx512 engine's bf16 products run on VDPBF16PS (one instruction a k-pair;
    linear.h says why its bits are the FMA chain's; a probe at first use checks that on the CPU). The build must say
    so — else the comparisons above would pass on the FMA path and never test this one — and a verify-sized block
    (12 rows, one tile; 13, two) must equal the avx2 engine's FMA chains where that runs, and its rows alone."""
    info = native.load_build("avx512").build_info()
    assert "+bf16" in info, info
    if "+bf16(off" in info:  # the once-per-process probe (linear_fma.cpp dp_bf16_exact) found other rounding here
        pytest.skip(f"VDPBF16PS does not round like two FMAs on this CPU, the FMA kernel runs ({info})")
    for shape in [(12, 64, 576), (13, 32, 130)]:
        run = _linear_case("bf16", shape, "plain", seed=7)
        x = _activations(shape, "bf16", seed=7)
        with native.use_engine("avx512"):
            got = run(x)
            for m in (0, shape[0] - 1):
                assert _same(run(x[m:m + 1].contiguous(), slice(m, m + 1))[0], got[m])
        if "avx2" in ENGINES:
            with native.use_engine("avx2"):
                assert _same(run(x), got), f"{shape}: VDPBF16PS differs from the FMA chain"
