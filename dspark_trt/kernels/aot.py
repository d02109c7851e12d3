"""Ahead-of-time compilation of the plugin kernels for a CUDA target (no GPU needed): the PTX/cubin that
TensorRT QDP `aot_impl` hands to TensorRT, plus the launch facts TensorRT needs (kernel name, threads per block,
dynamic shared memory) and the parameter list the PTX really declares (to check the QDP ABI).

Owns only the triton.compile call; which kernels, signatures and constexprs is each plugin's trt.py business.
Must run with TRITON_INTERPRET unset (interpreted kernels cannot be compiled).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

DEFAULT_ARCH = 90  # H100/H200 (sm_90)
WARP = 32


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One kernel compiled for one GPU architecture."""

    name: str  # PTX entry name (what TensorRT launches)
    ptx: str
    cubin: bytes
    arch: int
    num_warps: int
    shared_mem: int  # bytes of dynamic shared memory the launch must request
    ptx_params: tuple[str, ...]  # .param names of the entry, in order

    @property
    def block_x(self) -> int:
        """Threads per block."""
        return self.num_warps * WARP


def ptx_entry_params(ptx: str, name: str) -> tuple[str, ...]:
    """Names of the .param entries of `.entry name(...)` in a PTX module."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise ValueError(f"entry {name} not found in PTX")
    return tuple(re.findall(r"\.param\s+\.[\w.]+\s+(?:\.ptr\s+\.global\s+\.align\s+\d+\s+)?([\w$]+)", m.group(1)))


def qdp_ptx(ck: CompiledKernel, user_params: int) -> str:
    """The PTX handed to TensorRT QDP: Triton's implicit trailing scratch pointers removed from the entry.

    TensorRT launches an AOT kernel with exactly (inputs, extra_args, outputs); Triton 3.6 declares two more
    pointer parameters (global/profile scratch). Our kernels never use scratch, so those parameters are
    unreferenced and dropping them gives an entry whose ABI is exactly what TensorRT passes. Raises if a
    trailing parameter is referenced (a kernel that needs scratch cannot be a QDP AOT plugin as is)."""
    extra = ck.ptx_params[user_params:]
    if not extra:
        return ck.ptx
    m = re.search(r"\.entry\s+" + re.escape(ck.name) + r"\s*\((.*?)\)", ck.ptx, re.S)
    assert m is not None
    body = ck.ptx[m.end():]
    for p in extra:
        if re.search(r"\b" + re.escape(p) + r"\b", body):
            raise RuntimeError(f"{ck.name}: implicit parameter {p} is used; this kernel cannot be launched by QDP")
    decls = [d for d in m.group(1).split(",")]
    kept = [d for d in decls if not any(re.search(r"\b" + re.escape(p) + r"\b", d) for p in extra)]
    new_sig = ",".join(kept).rstrip()
    return ck.ptx[: m.start(1)] + new_sig + "\n" + ck.ptx[m.end(1):]


def compile_kernel(
    fn: Any,  # a triton.jit function (not interpreted)
    signature: Mapping[str, str],  # every parameter → "*fp32" / "*bf16" / "*i64" / "i32" / "constexpr"
    constexprs: Mapping[str, Any],
    num_warps: int,
    arch: int = DEFAULT_ARCH,
) -> CompiledKernel:
    """triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32)) → CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(fn, "arg_names") or type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError("AOT compile needs real triton.jit kernels: unset TRITON_INTERPRET before importing dspark_trt.kernels")
    missing = [a for a in fn.arg_names if a not in signature]
    if missing:
        raise ValueError(f"signature misses parameters {missing} of {fn.__name__}")
    src = ASTSource(fn=fn, signature=dict(signature), constexprs=dict(constexprs))
    ck = triton.compile(src, target=GPUTarget("cuda", arch, WARP), options={"num_warps": num_warps})
    name = ck.metadata.name
    ptx = ck.asm["ptx"]
    return CompiledKernel(
        name=name, ptx=ptx, cubin=ck.asm.get("cubin", b""), arch=arch, num_warps=ck.metadata.num_warps,
        shared_mem=int(ck.metadata.shared), ptx_params=ptx_entry_params(ptx, name),
    )
