"""Run in a subprocess with TRITON_INTERPRET unset: AOT-compile every kernel for sm_90 and drive the TensorRT
QDP registration through the fake tensorrt; print one JSON report on stdout (read by test_aot_trt.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fake_trt  # noqa: E402

_fake_trt.install()

from dspark_trt.kernels import trt as all_trt  # noqa: E402
from dspark_trt.kernels.block_draft import trt as bd  # noqa: E402
from dspark_trt.kernels.block_draft.split import compile_split  # noqa: E402
from dspark_trt.kernels.fused_accept import trt as fa  # noqa: E402

D = _fake_trt.TensorDesc


def _aot_row(plugin_id: str, result: tuple, user_params: int) -> dict:
    name, ptx, lp, extra = result
    ptx_s = ptx.decode()
    from dspark_trt.kernels.aot import ptx_entry_params

    params = ptx_entry_params(ptx_s, name.decode())
    m = re.search(r"\.reqntid\s+(\d+)", ptx_s)
    return dict(plugin=plugin_id, kernel=name.decode(), target_sm90="sm_90" in ptx_s.split(".target", 1)[1][:12],
                ptx_params=len(params), user_params=user_params, grid=[int(lp.grid_x), int(lp.grid_y)],
                block_x=int(lp.block_x), reqntid=int(m.group(1)) if m else None, shared_mem=int(lp.shared_mem),
                extra=[int(e.value) for e in extra.items], ptxas=_ptxas(ptx_s))


def _ptxas(ptx: str) -> str:
    """Assemble the QDP PTX for sm_90a with nvcc's ptxas when present: 'ok', 'absent' or the error."""
    cuda_ptxas = "/usr/local/cuda/bin/ptxas"
    exe = shutil.which("ptxas") or (cuda_ptxas if os.path.exists(cuda_ptxas) else None)
    if exe is None:
        return "absent"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([exe, "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return "ok" if r.returncode == 0 else r.stderr[-500:]


def main() -> None:
    ids = all_trt.register_all()
    B, K, V, S = 4, 5, 49152, 8
    logits = D((B, K + 1, V), "bfloat16")
    i32 = lambda *s: D(tuple(s), "int32")  # noqa: E731
    f32 = lambda *s: D(tuple(s), "float32")  # noqa: E731
    rows = []
    pf, pi = _fake_trt.REGISTERED[fa.STATS.plugin_id](logits, i32(B), f32(B), splits=S)
    rows.append(_aot_row(fa.STATS.plugin_id, _fake_trt.AOT[fa.STATS.plugin_id](
        logits, i32(B), f32(B), S, outputs=(pf, pi), tactic=0), fa.STATS.user_params))
    args = (logits, i32(B, K), f32(B, K, V), i32(B), f32(B), i32(B), i32(B), pf, pi)
    outs = _fake_trt.REGISTERED[fa.FINALIZE.plugin_id](*args, splits=S, sampling=1)
    rows.append(_aot_row(fa.FINALIZE.plugin_id, _fake_trt.AOT[fa.FINALIZE.plugin_id](
        *args, S, 1, outputs=outs, tactic=0), fa.FINALIZE.user_params))
    G, R = 7, 256
    margs = (f32(B, G, V), i32(B), D((V, R), "bfloat16"), D((V, R), "bfloat16"), i32(V), f32(B), i32(B), i32(B),
             f32(B, G), f32(R), f32(G))
    mouts = _fake_trt.REGISTERED[bd.MARKOV.plugin_id](*margs, has_d2t=1, has_conf=1)
    rows.append(_aot_row(bd.MARKOV.plugin_id, _fake_trt.AOT[bd.MARKOV.plugin_id](
        *margs, 1, 1, outputs=mouts, tactic=0), bd.MARKOV.user_params))
    shapes = dict(stats=[pf.shape, pi.shape], finalize=[o.shape for o in outs], markov=[o.shape for o in mouts])
    extra_compiles = [fa.compile_stats("float32").name, fa.compile_finalize("float32", 1, False).name,
                      bd.compile_markov(16, "float32", "float32", False, False).name, *compile_split(256)]
    returned = {fa.STATS.plugin_id: 2, fa.FINALIZE.plugin_id: len(outs), bd.MARKOV.plugin_id: len(mouts)}
    schema = {pid: dict(tensors=t, attrs=a, outputs=n, returned=returned[pid])
              for pid, (t, a, n) in _fake_trt.SCHEMA.items()}
    print(json.dumps(dict(ids=list(ids), rows=rows, shapes=shapes, extra_compiles=extra_compiles, schema=schema)))


if __name__ == "__main__":
    main()
