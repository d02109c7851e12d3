"""build/NAME/manifest.json: what was built from what, with which tools, how long it took, how good it is.

Owns: hashing inputs (files, directories, JSON-able flags), the per-stage records that let an unchanged
stage be skipped on rerun (a stage is skipped when its key — hash of its inputs and flags — matches the
recorded one and its outputs still exist), package versions, and atomic writes. Must not know what the
stages do.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
PACKAGES: tuple[str, ...] = ("torch", "transformers", "nvidia-modelopt", "safetensors", "tensorrt-llm",
                             "tensorrt", "tokenizers", "dspark_trt")


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution, or None when absent."""
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = None
    return out


def hash_file(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes (first 16 hex digits)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()[:16]


def hash_dir(path: Path, patterns: tuple[str, ...] = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")
             ) -> dict[str, str]:
    """{relative file name: sha256} for the checkpoint-relevant files of a directory (not recursive)."""
    path = Path(path)
    files = sorted({p for pat in patterns for p in path.glob(pat) if p.is_file()})
    return {p.name: hash_file(p) for p in files}


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


@dataclass
class StageRecord:
    """One stage's entry in the manifest."""

    key: str  # hash of inputs + flags
    outputs: dict[str, Any] = field(default_factory=dict)  # paths (relative to the build dir) and facts
    seconds: float = 0.0
    finished_at: str = ""
    skipped: bool = False  # True in the manifest of a run that reused it


class Manifest:
    """Load-modify-save wrapper around build/NAME/manifest.json."""

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = Path(build_dir)
        self.path = self.build_dir / "manifest.json"
        self.data: dict[str, Any] = {"manifest_version": MANIFEST_VERSION, "stages": {}}
        if self.path.is_file():
            try:
                loaded = json.loads(self.path.read_text())
                if loaded.get("manifest_version") == MANIFEST_VERSION:
                    self.data = loaded
            except (OSError, json.JSONDecodeError) as e:
                log.warning("ignoring unreadable %s (%s); every stage will run", self.path, e)
        self.data.setdefault("stages", {})

    def stage(self, name: str) -> StageRecord | None:
        d = self.data["stages"].get(name)
        return StageRecord(**d) if d else None

    def up_to_date(self, name: str, key: str) -> bool:
        """The stage ran with the same key and every recorded output path still exists."""
        rec = self.stage(name)
        if rec is None or rec.key != key:
            return False
        for p in rec.outputs.get("paths", []):
            if not (self.build_dir / p).exists():
                return False
        return True

    def record(self, name: str, rec: StageRecord) -> None:
        self.data["stages"][name] = rec.__dict__

    def mark_skipped(self, name: str, skipped: bool) -> None:
        if name in self.data["stages"]:
            self.data["stages"][name]["skipped"] = skipped

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def save(self) -> None:
        self.data["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.data["host"] = {"python": platform.python_version(), "machine": platform.machine()}
        write_json_atomic(self.path, self.data)
