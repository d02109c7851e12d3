"""AOT compilation for sm_90 and the TensorRT QDP contract, checked without a GPU and without TensorRT.

One subprocess (TRITON_INTERPRET unset) compiles every kernel with triton.compile(ASTSource, GPUTarget("cuda",
90, 32)) and drives dspark_trt/kernels/*/trt.py through a fake tensorrt.plugin (tests/kernels/_fake_trt.py); the tests
check its JSON report against the declared specs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_trt.errors import BuildError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(HERE / "_aot_probe.py")], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plugin_ids_namespace_version() -> None:
    from dspark_trt.kernels import _trt
    from dspark_trt.kernels.trt import ALL_SPECS

    assert _trt.NAMESPACE == "dspark" and _trt.VERSION == "1"
    assert [s.plugin_id for s in ALL_SPECS] == ["dspark::accept_stats", "dspark::accept_finalize",
                                                "dspark::markov_block"]


def test_io_specs_and_dtypes() -> None:
    from dspark_trt.kernels.block_draft.trt import MARKOV
    from dspark_trt.kernels.fused_accept.trt import FINALIZE, STATS

    assert [i.name for i in STATS.inputs] == ["logits", "k", "temperature"]
    assert STATS.inputs[0].dtypes == ("bfloat16", "float32", "float16")
    assert [(o.name, o.dtypes) for o in STATS.outputs] == [("part_f", ("float32",)), ("part_i", ("int32",))]
    assert [o.name for o in FINALIZE.outputs] == ["accepted", "next_token", "top1", "margin"]
    assert FINALIZE.outputs[0].dtypes == ("int32",) and FINALIZE.outputs[2].dtypes == ("float32",)
    assert [o.name for o in MARKOV.outputs] == ["tokens", "q", "conf"]
    assert dict(FINALIZE.attrs) == {"splits": int, "sampling": int}


def test_kernel_signatures_follow_qdp_abi() -> None:
    """Kernel parameters: every input pointer, then the int32 scalars, then every output pointer."""
    from dspark_trt.kernels.block_draft import trt as bd
    from dspark_trt.kernels.fused_accept import trt as fa

    for spec, sig in ((fa.STATS, fa.kernel_signature(fa.STATS)), (fa.FINALIZE, fa.kernel_signature(fa.FINALIZE)),
                      (bd.MARKOV, bd.kernel_signature())):
        kinds = ["ptr" if t.startswith("*") else "i32" for t in sig.values()]
        n_in, n_s = len(spec.inputs), len(spec.scalars)
        assert kinds == ["ptr"] * n_in + ["i32"] * n_s + ["ptr"] * len(spec.outputs), spec.name
        assert list(sig)[n_in:n_in + n_s] == list(spec.scalars)


def test_register_without_tensorrt_is_a_clear_build_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark_trt.kernels import _trt

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` fail
    with pytest.raises(BuildError, match="TensorRT"):
        _trt.import_trt()


def test_every_plugin_compiles_for_sm90(probe: dict) -> None:
    assert probe["ids"] == ["dspark::accept_stats", "dspark::accept_finalize", "dspark::markov_block"]
    assert probe["extra_compiles"][-2:] == ["markov_tile_kernel", "markov_pick_kernel"]  # split variant (CUDA path)
    assert len(probe["extra_compiles"]) == 5
    for row in probe["rows"]:
        assert row["target_sm90"], row
        # the QDP PTX declares exactly inputs + int32 scalars + outputs: Triton's 2 unused scratch pointers
        # (which TensorRT would not pass) are stripped by dspark_trt.kernels.aot.qdp_ptx
        assert row["ptx_params"] == row["user_params"], row
        assert row["reqntid"] == row["block_x"], row
        assert row["ptxas"] in ("ok", "absent"), row["ptxas"]


def test_qdp_schema_matches_specs(probe: dict) -> None:
    """What tensorrt.plugin would parse from the registered functions equals the declared specs."""
    from dspark_trt.kernels.trt import ALL_SPECS

    for spec in ALL_SPECS:
        got = probe["schema"][spec.plugin_id]
        assert got["tensors"] == [i.name for i in spec.inputs], spec.name
        assert got["attrs"] == [a for a, _ in spec.attrs], spec.name
        assert got["outputs"] == got["returned"] == len(spec.outputs), spec.name


def test_aot_launch_params_match_declarations(probe: dict) -> None:
    from dspark_trt.kernels.fused_accept import trt as fa

    rows = {r["plugin"]: r for r in probe["rows"]}
    b, kp1, v, splits = 4, 6, 49152, 8
    s, chunk = fa.split_plan(v, splits)
    st = rows["dspark::accept_stats"]
    assert st["grid"] == [b * kp1, s] and st["block_x"] == 256
    assert st["extra"] == [v, kp1, s, chunk, kp1 * v, v]
    fin = rows["dspark::accept_finalize"]
    assert fin["grid"] == [b, 1] and fin["block_x"] == 128
    assert fin["extra"] == [v, kp1, s, kp1 * v, v, kp1 - 1, (kp1 - 1) * v, v]
    mk = rows["dspark::markov_block"]
    assert mk["grid"] == [b, 1] and mk["extra"] == [v, 256, 7, 7 * v, v]
    assert probe["shapes"]["stats"] == [[b * kp1, s, 3], [b * kp1, s]]
    assert probe["shapes"]["markov"] == [[b, 7], [b, 7, v], [b, 7]]


def test_qdp_ptx_refuses_kernels_that_use_scratch() -> None:
    from dspark_trt.kernels.aot import CompiledKernel, qdp_ptx

    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n"
           "\tld.param.u64 %rd1, [k_param_1];\n}\n")
    ck = CompiledKernel("k", ptx, b"", 90, 4, 0, ("k_param_0", "k_param_1"))
    with pytest.raises(RuntimeError, match="k_param_1"):
        qdp_ptx(ck, 1)
    unused = ck.ptx.replace("[k_param_1]", "[k_param_0]")
    stripped = qdp_ptx(CompiledKernel("k", unused, b"", 90, 4, 0, ck.ptx_params), 1)
    assert "k_param_1" not in stripped and "k_param_0" in stripped
