"""scripts/bench_serving_grid.py (the policy × concurrency grid under load, issue #23): a small grid through the real
tritonserver on the tiny build (mixed chat + long code prompts; every cell's answers equal their single-stream
answers, K per round paired with the round's batch size, each row's per-request proposers in its stats, the report
and plot written), the mismatch check on its own, and the rows' `proposers` fields through the worker: DSpark alone
and hybrid requests in one batch on a server whose DSPARK_PROPOSERS is unset."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.validate import GenerationParams, check_proposers
from dspark_trt.serve.worker import PROPOSERS_ENV, InflightBatcher, Job, proposers_from_env, serving_backend, \
    to_loop_request
from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler

from .conftest import GAMMA, MAX_SEQ_LEN
from .test_worker import Sink

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_serving_grid as grid  # noqa: E402
import serving_grid_report as report  # noqa: E402


def _jobs(reference, max_tokens: int) -> list:  # noqa: ANN001
    return grid.make_jobs(reference.pair.tokenizer, room=MAX_SEQ_LEN - GAMMA - 1, max_tokens=max_tokens,
                          long_tokens=120)


def test_policy_rows_and_job_mix(reference) -> None:  # noqa: ANN001
    specs = {s.name: s for s in grid.policy_specs(grid.POLICY_NAMES, gamma=GAMMA, min_k=2)}
    assert (specs["fixed3"].policy, specs["fixed3"].max_k, specs["fixedg"].max_k) == ("fixed", 3, GAMMA)
    assert (specs["fixed0"].policy, specs["fixed0"].min_k, specs["fixed0"].max_k) == ("fixed", 0, 0)  # K ≡ 0
    assert specs["plain"].proposers is None  # the plain policy proposes nothing: no field sent
    assert all(specs[n].proposers == "dspark" for n in ("fixed0", "fixed3", "fixedg", "confidence", "survival"))
    assert (specs["survival+suffix"].policy, specs["survival+suffix"].proposers) == ("survival", "dspark,suffix")
    assert all(check_proposers(s.proposers) is not None for n, s in specs.items()
               if n not in ("plain", "default"))  # valid fields
    assert specs["default"].proposers is None and specs["suffix"].proposers == "suffix"  # the server's / the match
    assert all(s.exact for s in specs.values())  # greedy: every row must give the single-stream answer
    hot = {s.name: s for s in grid.policy_specs(grid.POLICY_NAMES, gamma=GAMMA, min_k=2, temperature=0.7)}
    assert {n for n, s in hot.items() if s.exact} == {"plain", "fixed0", "suffix", "default"}
    with pytest.raises(InvalidArgumentError, match="unknown"):
        grid.policy_specs(["fixed9"], GAMMA, 2)
    jobs = _jobs(reference, 16)
    kinds = [j.kind for j in jobs]
    assert kinds[:3] == ["chat", "code", "chat"] and kinds.count("code") == 4
    longest = max(len(reference.ids(j.prompt)) for j in jobs if j.kind == "code")
    assert 60 <= longest <= MAX_SEQ_LEN - GAMMA - 1 - 16  # long, and still room for the answer
    for c in (1, 3):  # every level mixes short chat and long code prompts
        plan = grid.cell_jobs(c, 2, len(jobs))
        assert {jobs[i].kind for p in plan for i in p} == {"chat", "code"}


def test_mismatch_and_error_are_reported() -> None:
    jobs = [grid.Job("chat", "a", True, 4), grid.Job("code", "b", False, 4)]
    refs = {0: [1, 2, 3], 1: [4, 5, 6]}
    good = grid.Sample(0, ids=[1, 2, 3], t_send=0.0, t_first=0.01, gaps=[0.002, 0.004],
                       stats={"k_per_round": [2, 3], "batch_per_round": [1, 2], "tau": 1.5})
    wrong = grid.Sample(1, ids=[4, 9, 6], t_send=0.0, t_first=0.02, gaps=[0.003],
                        stats={"k_per_round": [1], "batch_per_round": [2]})
    cell = grid.summarize_cell([good, wrong, grid.Sample(1, error="boom")], 2.0, refs, jobs)
    assert (cell["ok"], cell["wrong"], cell["errors"], cell["tokens"]) == (1, 1, 1, 6)
    assert cell["first_wrong"] == [{"job": 1, "kind": "code", "first_difference_at": 1, "got": 3, "want": 3}]
    assert cell["k_by_batch"] == {"1": {"mean_k": 2.0, "rounds": 1}, "2-3": {"mean_k": 2.0, "rounds": 2}}
    assert cell["ttft_ms"] == {"p50": 10.0, "p99": 20.0} and cell["itl_ms"]["p50"] == 3.0
    text = report.markdown({"setup": _setup(), "jobs": [{"kind": "chat"}, {"kind": "code"}], "machine": "m",
                            "commit": "c", "cells": [dict(policy="plain", concurrency=1, **cell)]})
    assert "FAIL: every answer under load equals its single-stream answer (1 equal, 1 different, 1 errors)" in text
    assert "mismatch: plain c=1: job 1 (code) differs from its single-stream answer at token 1" in text


def test_rounds_rotate_the_policy_order_and_pool_each_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [grid.Job("chat", "a", True, 4), grid.Job("code", "b", False, 4)]
    order: list[tuple[int, str]] = []
    walls = iter([1.0, 2.0, 4.0, 1.0, 2.0, 4.0, 1.0, 2.0, 4.0])

    def fake_cell(url, jobs_, spec, c, requests, timeout):  # noqa: ANN001, ANN202
        order.append((c, spec.name))
        return [grid.Sample(i % 2, ids=[1, 2, 3, 4], t_send=0.0, t_first=0.01, gaps=[0.002]) for i in range(c)], \
            next(walls)

    monkeypatch.setattr(grid, "run_cell", fake_cell)
    monkeypatch.setattr(grid, "reference_answers", lambda url, jobs_, needed, timeout, plain: {0: [1, 2, 3, 4],
                                                                                                1: [1, 2, 3, 4]})
    specs = grid.policy_specs(["plain", "fixed3", "survival"], gamma=GAMMA, min_k=1)
    result = grid.run_grid("u", specs, [2], 1, jobs, timeout=1.0, rounds=3)
    assert [n for _, n in order] == ["plain", "fixed3", "survival", "fixed3", "survival", "plain",
                                     "survival", "plain", "fixed3"]  # no row always first
    cells = {c["policy"]: c for c in result["cells"]}
    assert len(result["cells"]) == 3 and all(c["ok"] == 6 and c["tokens"] == 24 for c in cells.values())
    assert cells["plain"]["tok_s_rounds"] == [8.0, 2.0, 4.0]  # plain's walls: 1.0, 4.0, 2.0
    assert cells["plain"]["tok_s"] == round(24 / 7.0, 2)  # pooled tokens over the summed wall


def _setup() -> dict:
    return {"repo": "r", "gamma": GAMMA, "kv_slots": 16, "max_seq_len": MAX_SEQ_LEN, "max_queue": 64,
            "threads": "auto", "requests_per_cell": 1, "max_tokens": 12, "long_tokens": 120, "load_before": [0, 0, 0],
            "load_after": [0, 0, 0], "wall_s": 1.0}


@pytest.mark.triton
def test_small_grid_through_triton(server, reference, tmp_path: Path) -> None:  # noqa: ANN001
    jobs = _jobs(reference, 12)
    specs = grid.policy_specs(["plain", "fixed3", "survival", "survival+suffix"], gamma=GAMMA, min_k=1)
    result = grid.run_grid(server.grpc_url, specs, [1, 3], 1, jobs, timeout=300.0)  # every row on one server
    cells = {(c["policy"], c["concurrency"]): c for c in result["cells"]}
    assert len(cells) == 8
    for key, c in cells.items():
        assert c["errors"] == 0 and c["wrong"] == 0 and c["ok"] == key[1], (key, c["first_errors"], c["first_wrong"])
        assert c["tokens"] > 0 and c["ttft_ms"]["p50"] is not None and c["rounds"] > 0
        assert sum(b["rounds"] for b in c["k_by_batch"].values()) == c["rounds"]  # every round has its batch size
    assert all(cells[("plain", c)]["mean_k"] == 0 for c in (1, 3))
    assert all(0 < cells[("fixed3", c)]["mean_k"] <= 3 for c in (1, 3))
    # each row's proposers travel in its requests: DSpark alone where named so (not the greedy default, both),
    # both on the hybrid row, none under plain, whatever the server's DSPARK_PROPOSERS
    for c in (1, 3):
        assert cells[("plain", c)]["proposers_allowed"] == ["none"] and not cells[("plain", c)]["by_proposer"]
        for pol in ("fixed3", "survival"):
            assert cells[(pol, c)]["proposers_allowed"] == ["dspark"], (pol, c)
            assert set(cells[(pol, c)]["by_proposer"]) <= {"dspark"}, (pol, c, cells[(pol, c)]["by_proposer"])
        assert cells[("fixed3", c)]["by_proposer"]["dspark"]["rounds"] > 0
        assert cells[("survival+suffix", c)]["proposers_allowed"] == ["dspark,suffix"]
        assert set(cells[("survival+suffix", c)]["by_proposer"]) <= {"dspark", "suffix"}
    # the suffix match offers drafts on the hybrid row (code prompts repeat; earlier cells' outputs are indexed)
    assert any("suffix" in cells[("survival+suffix", c)]["by_proposer"] for c in (1, 3))
    # the references are the server's own answers alone, and equal in-process plain generation
    code = [i for i in map(int, result["references"]) if not jobs[i].chat]
    assert code and all(result["references"][str(i)] == reference(jobs[i].prompt, 12) for i in code)
    result["setup"] = _setup()
    text = report.write_outputs(result, tmp_path)
    assert "PASS: every answer under load equals its single-stream answer (16 equal, 0 different, 0 errors)" in text
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "grid.json").is_file()


@pytest.mark.triton
def test_small_sampled_grid_through_triton(server, reference, tmp_path: Path) -> None:  # noqa: ANN001
    """--temperature: every request samples, job i seeded alike in every row and the references; the rows the
    suffix match drafts (named, or the server's default for a seeded request) give plain sampling's answer under
    load; a DSpark row's answers are counted apart (other draws), never as wrong."""
    jobs = _jobs(reference, 12)
    specs = grid.policy_specs(["plain", "default", "suffix", "survival"], gamma=GAMMA, min_k=1, temperature=0.8,
                              seed_base=5)
    result = grid.run_grid(server.grpc_url, specs, [1, 3], 1, jobs, timeout=300.0)
    cells = {(c["policy"], c["concurrency"]): c for c in result["cells"]}
    for key, c in cells.items():
        assert c["errors"] == 0 and c["wrong"] == 0, (key, c["first_errors"], c["first_wrong"])
    for c in (1, 3):
        for pol in ("plain", "default", "suffix"):
            assert cells[(pol, c)]["ok"] == c and cells[(pol, c)]["other_draws"] == 0, (pol, c)
        assert cells[("default", c)]["proposers_allowed"] == ["suffix"]  # a seeded request's default
    result["setup"] = dict(_setup(), temperature=0.8, seed=5)
    text = report.write_outputs(result, tmp_path)
    assert "sampled at T 0.8, job i seeded 5 + i" in text and "PASS: every answer under load" in text


def test_server_proposers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROPOSERS_ENV, "suffix,dspark")
    assert proposers_from_env() == ("dspark", "suffix")
    monkeypatch.setenv(PROPOSERS_ENV, "ngram")
    with pytest.raises(InvalidArgumentError, match=PROPOSERS_ENV):
        proposers_from_env()
    monkeypatch.delenv(PROPOSERS_ENV)
    assert proposers_from_env() is None  # unset: each request its field, else its default (both when greedy)


def test_row_proposers_per_request_in_one_batch(reference) -> None:  # noqa: ANN001
    """The survival and survival+suffix rows' fields, in one batch on a batcher with no server proposers (the grid's
    one server, DSPARK_PROPOSERS unset): each request proposes with its own field, and its stats say so."""
    specs = {s.name: s for s in grid.policy_specs(["survival", "survival+suffix"], gamma=GAMMA, min_k=1)}
    rows = {name: GenerationParams(max_tokens=24, stream=True, policy=spec.policy, min_k=1, max_k=GAMMA,
                                   return_stats=True, proposers=check_proposers(spec.proposers))
            for name, spec in specs.items()}
    assert to_loop_request((1, 2, 3), rows["survival"], ()).policy.proposers == ("dspark",)  # not the default, both
    assert to_loop_request((1, 2, 3), rows["survival+suffix"], ()).policy.proposers == ("dspark", "suffix")

    from dspark_trt.runtime.backend import SpecBackend

    metrics = ServeMetrics(None, gamma=GAMMA)
    backend = serving_backend(SpecBackend(reference.pair.target, reference.pair.drafter, max_batch=4,
                                          max_seq=MAX_SEQ_LEN), metrics)
    batcher = InflightBatcher(RoundScheduler(backend, LoopConfig(gamma=GAMMA)), metrics, 64, proposers=None).start()
    prompt = "ab ab ab ab ab ab ab ab"  # repeats: the suffix match proposes
    sinks = {(name, n): Sink() for name in rows for n in range(2)}
    for (name, _), sink in sinks.items():
        batcher.submit(Job(tuple(reference.ids(prompt)), rows[name], sink, reference.eos))
    for sink in sinks.values():
        assert sink.done.wait(300)
    batcher.stop()
    for (name, _), sink in sinks.items():
        assert sink.err is None and sink.ids == reference(prompt, 24), name
        assert len(sink.stats["batch_per_round"]) == len(sink.stats["k_per_round"]) > 0
        assert sink.stats["proposers_allowed"] == specs[name].proposers.split(","), name
        assert set(sink.stats["proposers"]) <= set(sink.stats["proposers_allowed"]), name
    assert any("suffix" in s.stats["proposers"] for (name, _), s in sinks.items() if name == "survival+suffix")


def test_aiperf_dataset_export(tmp_path: Path) -> None:
    import json

    jobs = [grid.Job("chat", "Hi?", True, 8), grid.Job("code", 'def f():\n    return "x"\n', False, 8)]
    grid.export_aiperf(tmp_path / "a" / "prompts.jsonl", jobs)
    lines = (tmp_path / "a" / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == [{"text": "Hi?"}, {"text": 'def f():\n    return "x"\n'}]
