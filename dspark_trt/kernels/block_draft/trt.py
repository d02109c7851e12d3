"""TensorRT QDP registration of the DSpark Markov block: one AOT plugin, one kernel launch for γ steps.

    dspark::markov_block (U [B,γ,Vd], anchor [B], W1 [Vt,r], W2 [Vd,r], d2t [Vd], temperature [B], seeds [B],
                          positions [B], conf_bias [B,γ], w_conf [r], conf_temp [γ])
                       → tokens [B,γ] int32, q [B,γ,Vd] fp32, conf [B,γ] fp32

`aot_impl` compiles kernel.markov_block_kernel to PTX (the engine carries it; no Python at run time).
Attributes: `has_d2t`, `has_conf` (0/1 → the kernel's constexprs; unused inputs may be 1-element dummies).
Owns the spec, signature and registration; imports tensorrt only inside `register()`.
No `from __future__ import annotations` here: tensorrt.plugin inspects the registered functions' annotations.
"""
import logging
from typing import Tuple

from dspark_trt.kernels._trt import IOSpec, PluginSpec, TRITON_PTR, const_dim, import_trt, trt_dtype_name
from dspark_trt.kernels.aot import DEFAULT_ARCH, CompiledKernel, compile_kernel, qdp_ptx
from dspark_trt.kernels.block_draft import launch

log = logging.getLogger(__name__)

FLOATS = ("float32", "bfloat16", "float16")
IDS = ("int32",)

MARKOV = PluginSpec(
    name="markov_block",
    inputs=(
        IOSpec("U", ("float32", "bfloat16", "float16"), 3), IOSpec("anchor", IDS, 1), IOSpec("w1", FLOATS, 2),
        IOSpec("w2", FLOATS, 2), IOSpec("d2t", IDS, 1), IOSpec("temperature", ("float32",), 1),
        IOSpec("seeds", IDS, 1), IOSpec("positions", IDS, 1), IOSpec("conf_bias", ("float32",), 2),
        IOSpec("w_conf", ("float32",), 1), IOSpec("conf_temp", ("float32",), 1),
    ),
    scalars=("V", "R", "GAMMA", "stride_ub", "stride_uk"),
    outputs=(IOSpec("tokens", IDS, 2), IOSpec("q", ("float32",), 3), IOSpec("conf", ("float32",), 2)),
    attrs=(("has_d2t", int), ("has_conf", int)),
)
SPECS = (MARKOV,)

_ARGS = ("u_ptr", "anchor_ptr", "w1_ptr", "w2_ptr", "d2t_ptr", "temp_ptr", "seed_ptr", "pos_ptr", "cbias_ptr",
         "wconf_ptr", "ctemp_ptr", "V", "R", "GAMMA", "stride_ub", "stride_uk", "tok_ptr", "q_ptr", "conf_ptr")


def kernel_signature(u_dtype: str = "float32", w_dtype: str = "bfloat16") -> dict[str, str]:
    """Triton AOT signature of markov_block_kernel as the plugin launches it."""
    ptrs = [a for a in _ARGS if a.endswith("_ptr")]
    ios = MARKOV.inputs + MARKOV.outputs
    sig: dict[str, str] = {}
    for pname, io in zip(ptrs, ios):
        dt = u_dtype if io.name == "U" else w_dtype if io.name in ("w1", "w2") else io.dtypes[0]
        sig[pname] = "*" + TRITON_PTR[dt]
    sig.update({s: "i32" for s in MARKOV.scalars})
    return {a: sig[a] for a in _ARGS}


def compile_markov(rank: int, u_dtype: str = "float32", w_dtype: str = "bfloat16", has_d2t: bool = False,
                   has_conf: bool = True, arch: int = DEFAULT_ARCH) -> CompiledKernel:
    """PTX/cubin of markov_block_kernel for Markov rank `rank`."""
    from dspark_trt.kernels.block_draft.kernel import markov_block_kernel

    block_r, block_v = launch.tiles(rank)
    sig = kernel_signature(u_dtype, w_dtype)
    sig.update({"HAS_D2T": "constexpr", "HAS_CONF": "constexpr", "BLOCK_R": "constexpr", "BLOCK_V": "constexpr"})
    consts = {"HAS_D2T": bool(has_d2t), "HAS_CONF": bool(has_conf), "BLOCK_R": block_r, "BLOCK_V": block_v}
    return compile_kernel(markov_block_kernel, sig, consts, launch.NUM_WARPS, arch)


def register(arch: int = DEFAULT_ARCH) -> tuple[str, ...]:
    """Register dspark::markov_block with tensorrt.plugin; returns its id."""
    trt, trtp = import_trt()

    Desc, Ret = trtp.TensorDesc, Tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]

    @trtp.register(MARKOV.plugin_id)
    def _desc(U: Desc, anchor: Desc, w1: Desc, w2: Desc, d2t: Desc, temperature: Desc, seeds: Desc, positions: Desc,
              conf_bias: Desc, w_conf: Desc, conf_temp: Desc, has_d2t: int, has_conf: int) -> Tuple[Desc, Desc, Desc]:
        b, g, v = U.shape_expr[0], U.shape_expr[1], U.shape_expr[2]
        return (trtp.from_shape_expr((b, g), dtype=trt.int32), trtp.from_shape_expr((b, g, v), dtype=trt.float32),
                trtp.from_shape_expr((b, g), dtype=trt.float32))

    @trtp.aot_impl(MARKOV.plugin_id)
    def _aot(U: Desc, anchor: Desc, w1: Desc, w2: Desc, d2t: Desc, temperature: Desc, seeds: Desc, positions: Desc,
             conf_bias: Desc, w_conf: Desc, conf_temp: Desc, has_d2t: int, has_conf: int,
             outputs: Tuple[Desc, Desc, Desc], tactic: int) -> Ret:
        rank = const_dim(w1.shape_expr[1], "the Markov rank (W1 dim 1)")
        ck = compile_markov(rank, trt_dtype_name(trt, U.dtype), trt_dtype_name(trt, w1.dtype), bool(has_d2t),
                            bool(has_conf), arch)
        g, v = U.shape_expr[1], U.shape_expr[2]
        lp = trtp.KernelLaunchParams()
        lp.grid_x = U.shape_expr[0]
        lp.block_x = ck.block_x
        lp.shared_mem = ck.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (v, rank, g, g * v, v)])
        return ck.name.encode(), qdp_ptx(ck, MARKOV.user_params).encode(), lp, extra

    log.info("registered TensorRT AOT plugin %s (sm_%d)", MARKOV.plugin_id, arch)
    return (MARKOV.plugin_id,)
