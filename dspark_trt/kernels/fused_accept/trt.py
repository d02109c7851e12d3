"""TensorRT QDP registration of fused acceptance: two AOT plugins that chain through a partials tensor.

    dspark::accept_stats    (logits [B,K+1,V], k [B], temperature [B])
                          → part_f [B*(K+1),S,3], part_i [B*(K+1),S]
    dspark::accept_finalize (logits, draft [B,K], q [B,K,V], k, temperature, seeds [B], positions [B],
                             part_f, part_i)
                          → accepted [B], next_token [B], top1 [B,K+1], margin [B,K+1]

Both are `tensorrt.plugin` AOT plugins: `aot_impl` compiles the very kernels of kernel.py to PTX, so the engine
carries the code and runs in the C++ TensorRT(-LLM) runtime with no Python (see docs/kernels.md for why not
tensorrt_llm.python_plugin). Attributes: `splits` (S, build-time), `sampling` (0: greedy-only build, q is a
dummy and never read). Token ids are int32 (TensorRT-LLM's convention); seeds are int32 bit patterns.
Owns the specs, signatures and registration; imports tensorrt only inside `register()`.
No `from __future__ import annotations` here: tensorrt.plugin inspects the registered functions' annotations as
real classes (TensorDesc subclasses, builtin attr types, an exact-arity Tuple of outputs).
"""
import logging
from typing import Tuple

import triton

from dspark_trt.kernels._trt import IOSpec, PluginSpec, TRITON_PTR, const_dim, import_trt, trt_dtype_name
from dspark_trt.kernels.aot import DEFAULT_ARCH, CompiledKernel, compile_kernel, qdp_ptx
from dspark_trt.kernels.fused_accept import launch

log = logging.getLogger(__name__)

LOGITS = ("bfloat16", "float32", "float16")
IDS = ("int32",)

STATS = PluginSpec(
    name="accept_stats",
    inputs=(IOSpec("logits", LOGITS, 3), IOSpec("k", IDS, 1), IOSpec("temperature", ("float32",), 1)),
    scalars=("V", "KP1", "S", "chunk", "stride_lb", "stride_lk"),
    outputs=(IOSpec("part_f", ("float32",), 3), IOSpec("part_i", ("int32",), 2)),
    attrs=(("splits", int),),
)
FINALIZE = PluginSpec(
    name="accept_finalize",
    inputs=(
        IOSpec("logits", LOGITS, 3), IOSpec("draft", IDS, 2), IOSpec("q", ("float32",), 3), IOSpec("k", IDS, 1),
        IOSpec("temperature", ("float32",), 1), IOSpec("seeds", IDS, 1), IOSpec("positions", IDS, 1),
        IOSpec("part_f", ("float32",), 3), IOSpec("part_i", ("int32",), 2),
    ),
    scalars=("V", "KP1", "S", "stride_lb", "stride_lk", "stride_db", "stride_qb", "stride_qk"),
    outputs=(IOSpec("accepted", IDS, 1), IOSpec("next_token", IDS, 1), IOSpec("top1", ("float32",), 2),
             IOSpec("margin", ("float32",), 2)),
    attrs=(("splits", int), ("sampling", int)),
)
SPECS = (STATS, FINALIZE)


def split_plan(vocab: int, splits: int) -> tuple[int, int]:
    """(S, chunk) actually used for a requested split count: chunk is a multiple of BLOCK_V."""
    tiles = triton.cdiv(vocab, launch.BLOCK_V)
    s = max(1, min(splits, tiles))
    chunk = triton.cdiv(tiles, s) * launch.BLOCK_V
    return triton.cdiv(vocab, chunk), chunk


# kernel parameter names of kernel.py, in ABI order, mapped from the spec's I/O names
_STATS_ARGS = ("logits_ptr", "k_ptr", "temp_ptr", "V", "KP1", "S", "chunk", "stride_lb", "stride_lk", "part_f_ptr",
               "part_i_ptr")
_FINAL_ARGS = ("logits_ptr", "draft_ptr", "q_ptr", "k_ptr", "temp_ptr", "seed_ptr", "pos_ptr", "part_f_ptr",
               "part_i_ptr", "V", "KP1", "S", "stride_lb", "stride_lk", "stride_db", "stride_qb", "stride_qk",
               "accepted_ptr", "next_ptr", "top1_ptr", "margin_ptr")


def kernel_signature(spec: PluginSpec, logits_dtype: str = "bfloat16") -> dict[str, str]:
    """Triton AOT signature (kernel parameter → type) for a plugin spec; pointer types follow the spec."""
    names = _STATS_ARGS if spec is STATS else _FINAL_ARGS
    ptr_names = [n for n in names if n.endswith("_ptr")]
    sig: dict[str, str] = {}
    for pname, io in zip(ptr_names[: len(spec.inputs)], spec.inputs):
        sig[pname] = "*" + TRITON_PTR[logits_dtype if io.name == "logits" else io.dtypes[0]]
    for pname, io in zip(ptr_names[len(spec.inputs):], spec.outputs):
        sig[pname] = "*" + TRITON_PTR[io.dtypes[0]]
    for s in spec.scalars:
        sig[s] = "i32"
    return {n: sig[n] for n in names}


def compile_stats(logits_dtype: str = "bfloat16", arch: int = DEFAULT_ARCH) -> CompiledKernel:
    """PTX/cubin of accept_stats_kernel as the accept_stats plugin launches it."""
    from dspark_trt.kernels.fused_accept.kernel import accept_stats_kernel

    sig = kernel_signature(STATS, logits_dtype)
    sig["BLOCK_V"] = "constexpr"
    return compile_kernel(accept_stats_kernel, sig, {"BLOCK_V": launch.BLOCK_V}, launch.NUM_WARPS, arch)


def compile_finalize(logits_dtype: str = "bfloat16", splits: int = 8, sampling: bool = True,
                     arch: int = DEFAULT_ARCH) -> CompiledKernel:
    """PTX/cubin of accept_finalize_kernel for S = splits partials (BLOCK_S = next pow2)."""
    from dspark_trt.kernels.fused_accept.kernel import accept_finalize_kernel

    sig = kernel_signature(FINALIZE, logits_dtype)
    sig.update({"HAS_Q": "constexpr", "BLOCK_S": "constexpr", "BLOCK_V": "constexpr"})
    consts = {"HAS_Q": bool(sampling), "BLOCK_S": triton.next_power_of_2(max(splits, 1)),
              "BLOCK_V": launch.FINAL_BLOCK_V}
    return compile_kernel(accept_finalize_kernel, sig, consts, launch.FINAL_NUM_WARPS, arch)


def register(arch: int = DEFAULT_ARCH) -> tuple[str, ...]:
    """Register dspark::accept_stats and dspark::accept_finalize with tensorrt.plugin; returns their ids."""
    trt, trtp = import_trt()

    Desc, Ret = trtp.TensorDesc, Tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]

    @trtp.register(STATS.plugin_id)
    def _stats_desc(logits: Desc, k: Desc, temperature: Desc, splits: int) -> Tuple[Desc, Desc]:
        v = const_dim(logits.shape_expr[2], "the vocabulary (logits dim 2)")
        s, _ = split_plan(v, splits)
        rows = logits.shape_expr[0] * logits.shape_expr[1]
        return (trtp.from_shape_expr((rows, s, 3), dtype=trt.float32),
                trtp.from_shape_expr((rows, s), dtype=trt.int32))

    @trtp.aot_impl(STATS.plugin_id)
    def _stats_aot(logits: Desc, k: Desc, temperature: Desc, splits: int, outputs: Tuple[Desc, Desc],
                   tactic: int) -> Ret:
        v = const_dim(logits.shape_expr[2], "the vocabulary (logits dim 2)")
        s, chunk = split_plan(v, splits)
        ck = compile_stats(trt_dtype_name(trt, logits.dtype), arch)
        kp1 = logits.shape_expr[1]
        lp = trtp.KernelLaunchParams()
        lp.grid_x = logits.shape_expr[0] * kp1
        lp.grid_y = s
        lp.block_x = ck.block_x
        lp.shared_mem = ck.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (v, kp1, s, chunk, kp1 * v, v)])
        return ck.name.encode(), qdp_ptx(ck, STATS.user_params).encode(), lp, extra

    @trtp.register(FINALIZE.plugin_id)
    def _final_desc(logits: Desc, draft: Desc, q: Desc, k: Desc, temperature: Desc, seeds: Desc, positions: Desc,
                    part_f: Desc, part_i: Desc, splits: int, sampling: int) -> Tuple[Desc, Desc, Desc, Desc]:
        b, kp1 = logits.shape_expr[0], logits.shape_expr[1]
        return (trtp.from_shape_expr((b,), dtype=trt.int32), trtp.from_shape_expr((b,), dtype=trt.int32),
                trtp.from_shape_expr((b, kp1), dtype=trt.float32), trtp.from_shape_expr((b, kp1), dtype=trt.float32))

    @trtp.aot_impl(FINALIZE.plugin_id)
    def _final_aot(logits: Desc, draft: Desc, q: Desc, k: Desc, temperature: Desc, seeds: Desc, positions: Desc,
                   part_f: Desc, part_i: Desc, splits: int, sampling: int, outputs: Tuple[Desc, Desc, Desc, Desc],
                   tactic: int) -> Ret:
        v = const_dim(logits.shape_expr[2], "the vocabulary (logits dim 2)")
        s, _ = split_plan(v, splits)
        ck = compile_finalize(trt_dtype_name(trt, logits.dtype), s, bool(sampling), arch)
        kp1 = logits.shape_expr[1]
        lp = trtp.KernelLaunchParams()
        lp.grid_x = logits.shape_expr[0]
        lp.block_x = ck.block_x
        lp.shared_mem = ck.shared_mem
        qk = kp1 - 1
        extra = trtp.SymIntExprs.from_tuple(
            [trtp.SymInt32(e) for e in (v, kp1, s, kp1 * v, v, qk, qk * v if sampling else 0, v if sampling else 0)])
        return ck.name.encode(), qdp_ptx(ck, FINALIZE.user_params).encode(), lp, extra

    log.info("registered TensorRT AOT plugins %s, %s (sm_%d)", STATS.plugin_id, FINALIZE.plugin_id, arch)
    return STATS.plugin_id, FINALIZE.plugin_id
