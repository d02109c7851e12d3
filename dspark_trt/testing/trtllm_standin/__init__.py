"""A python-backend stand-in for the `tensorrtllm` models of a GPU-host repository (build/NAME/model_repo_trtllm),
so the whole repository runs in the tritonserver here, where TensorRT-LLM cannot be installed. TESTING ONLY: it is
swapped into a COPY of the built repository and never shipped in dspark_trt/model_repo_trtllm/.

Owns install_standin (rewrite `target` / `draft` in a repository copy: `backend: "python"` instead of
"tensorrtllm", every tensor declaration and parameter kept, a 1/model.py over trtllm_standin.triton.StandinModel,
STANDIN.txt saying so). A DSpark pair's `target` is already a python model (the executor-bindings model,
serve/gpu_host/executor_model.py): its config is kept the same way and only its 1/model.py is swapped.
The semantics it answers with are trtllm_standin.engine's (the reference runtime, not an engine).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from dspark_trt.errors import InvalidArgumentError

log = logging.getLogger(__name__)

__all__ = ["ADAPTER_SOURCE", "install_standin", "standin_config"]

ADAPTER_SOURCE = '''"""STAND-IN (testing only) for a tensorrtllm model: dspark_trt.testing.trtllm_standin.triton.StandinModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.testing.trtllm_standin.triton import StandinModel


class TritonPythonModel(StandinModel):
    pb = pb_utils
'''
_BACKEND = re.compile(r'^backend:\s*"tensorrtllm"\s*$', re.M)
_PATH = re.compile(r'key:\s*"(?:gpt_model_path|engine_dir)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')
_EXECUTOR = re.compile(r'^backend:\s*"python"\s*$', re.M)  # the DSpark target (executor bindings) has engine_dir
_DELAY = re.compile(r"max_queue_delay_microseconds:\s*\d+")


def standin_config(text: str, role: str, build_dir: Path | None = None, queue_delay_us: int = 2000,
                   reuse_block: int = 0) -> str:
    """A filled tensorrtllm config.pbtxt → the same model on the python backend (tensors and parameters kept;
    the dynamic batcher waits queue_delay_us so concurrent requests form one batch; STANDIN_* parameters added)."""
    executor = bool(_EXECUTOR.search(text)) and 'key: "engine_dir"' in text
    if not _BACKEND.search(text) and not executor:
        raise InvalidArgumentError(f"the {role} config is not a tensorrtllm model (no `backend: \"tensorrtllm\"`) "
                                   "nor the DSpark executor target; pass a build/NAME/model_repo_trtllm copy")
    if build_dir is None:
        m = _PATH.search(text)
        if m is None:
            raise InvalidArgumentError(f"the {role} config has no gpt_model_path / engine_dir; pass build_dir")
        build_dir = Path(m.group(1)).parents[1]  # BUILD_DIR/engines/ROLE
    out = _BACKEND.sub('backend: "python"', text)
    out = _DELAY.sub(f"max_queue_delay_microseconds: {int(queue_delay_us)}", out)
    what = "executor target model's" if executor else "tensorrtllm model's"
    head = (f"# STAND-IN (testing only): the {what} interface on the python backend, answered by the "
            "reference runtime\n# (dspark_trt.testing.trtllm_standin); no TensorRT-LLM engine runs.\n")
    tail = (f'parameters: {{ key: "STANDIN_ROLE" value: {{ string_value: "{role}" }} }}\n'
            f'parameters: {{ key: "STANDIN_BUILD_DIR" value: {{ string_value: "{Path(build_dir).resolve()}" }} }}\n'
            f'parameters: {{ key: "STANDIN_REUSE_BLOCK" value: {{ string_value: "{int(reuse_block)}" }} }}\n')
    return head + out.rstrip("\n") + "\n" + tail


def install_standin(repo: Path, build_dir: Path | None = None, queue_delay_us: int = 2000,
                    reuse_block: int = 0) -> list[str]:
    """Swap the stand-in into `target` (and `draft`, when present) of a model_repo_trtllm COPY; returns the names."""
    repo = Path(repo)
    swapped = []
    for role in ("target", "draft"):
        cfg = repo / role / "config.pbtxt"
        if not cfg.is_file():
            continue
        cfg.write_text(standin_config(cfg.read_text(), role, build_dir, queue_delay_us, reuse_block))
        (repo / role / "1").mkdir(parents=True, exist_ok=True)
        (repo / role / "1" / "model.py").write_text(ADAPTER_SOURCE)
        (repo / role / "STANDIN.txt").write_text("This model is the testing stand-in for TensorRT-LLM's tensorrtllm "
                                                 "backend (dspark_trt.testing.trtllm_standin), not an engine.\n")
        swapped.append(role)
    if "target" not in swapped:
        raise InvalidArgumentError(f"{repo} has no target/config.pbtxt; pass a build/NAME/model_repo_trtllm copy")
    log.info("stand-in installed for %s in %s", ", ".join(swapped), repo)
    return swapped
