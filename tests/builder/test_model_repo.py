"""Template filling of dspark_trt/model_repo/: every key per the contract, unknown keys and leftover `${` fail."""
from __future__ import annotations

from pathlib import Path

import pytest

from dspark_trt.builder.model_repo import TEMPLATE_DIR, TEMPLATE_KEYS, fill_model_repo, fill_text, template_values
from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError

SPEC = BuildOptions(max_batch_size=3, max_draft_len=6, policy="survival", min_k=1, max_k=0, max_seq_len=300, max_queue=9)


def test_values_cover_contract_keys(tmp_path: Path) -> None:
    v = template_values(SPEC, tmp_path)
    assert set(v) == set(TEMPLATE_KEYS)
    assert v["GAMMA"] == "6" and v["MAX_K"] == "6" and v["POLICY"] == "survival" and v["BUILD_DIR"] == str(tmp_path.resolve())


def test_fill_text() -> None:
    vals = template_values(SPEC, Path("/b"))
    assert fill_text("max_batch_size: ${MAX_BATCH_SIZE}\nk: ${MIN_K}-${MAX_K}", vals, "x") == "max_batch_size: 3\nk: 1-6"
    with pytest.raises(BuildError, match=r"Unknown template key \$\{NOPE\} in t/config.pbtxt"):
        fill_text("a ${NOPE}", vals, "t/config.pbtxt")
    with pytest.raises(BuildError, match="line 2"):
        fill_text("ok ${GAMMA}\nbad ${ GAMMA}", vals, "t/config.pbtxt")
    with pytest.raises(BuildError, match="Malformed"):
        fill_text("${lower-case}", vals, "t")


def test_real_templates_fill_completely(tmp_path: Path) -> None:
    assert TEMPLATE_DIR.is_dir(), "the dspark_trt/model_repo/ templates are missing"
    facts = fill_model_repo(SPEC, tmp_path)
    repo = tmp_path / "model_repo"
    pbtxt = sorted(repo.rglob("config.pbtxt"))
    assert pbtxt and len(facts["filled"]) == len(pbtxt)
    for p in pbtxt:
        text = p.read_text()
        assert "${" not in text, p
    joined = "\n".join(p.read_text() for p in pbtxt)
    assert str(tmp_path.resolve()) in joined
    # everything else copied verbatim
    for src in TEMPLATE_DIR.rglob("*.py"):
        if "__pycache__" not in src.parts:
            assert (repo / src.relative_to(TEMPLATE_DIR)).read_text() == src.read_text()


def test_bad_template_leaves_no_partial_repo(tmp_path: Path) -> None:
    tpl = tmp_path / "tpl"
    (tpl / "m").mkdir(parents=True)
    (tpl / "m" / "config.pbtxt").write_text('name: "m"\nmax_batch_size: ${MAX_BATCH}\n')
    with pytest.raises(BuildError, match=r"\$\{MAX_BATCH\}.*m/config.pbtxt"):
        fill_model_repo(SPEC, tmp_path / "b", template=tpl)
    assert not (tmp_path / "b" / "model_repo").exists()
