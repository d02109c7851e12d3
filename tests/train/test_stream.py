"""Streamed drafter training (train.stream) on the tiny pair: the chunk plan, a whole stream through the CLI (teacher
pass per chunk, one schedule, milestones measured in the real loop, lossless), resume of a finished stream, and a
stream continued elsewhere from --init-from + --start-step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.train.chatgen import generate_answers
from dspark_trt.train.stream import StreamConfig, plan_chunks


def test_plan_covers_every_sequence_once_with_steps_by_answer_tokens() -> None:
    seqs = [list(range(10 + 3 * i)) for i in range(40)]
    starts = [4] * 40
    chunks = plan_chunks(seqs, starts, chunk_tokens=200, anchors_per_token=0.5, anchors_per_step=8, seed=3)
    assert sorted(i for c in chunks for i in c.seqs) == list(range(40))
    assert all(c.tokens >= 200 for c in chunks[:-1])
    assert [c.step_start for c in chunks[1:]] == [c.step_end for c in chunks[:-1]] and chunks[0].step_start == 0
    for c in chunks:
        assert c.answer_tokens == sum(len(seqs[i]) - 4 for i in c.seqs)
        assert c.step_end - c.step_start == max(1, round(0.5 * c.answer_tokens / 8))
    assert plan_chunks(seqs, starts, 200, 0.5, 8, seed=3) == chunks  # the plan depends on the corpus and seed only
    assert plan_chunks(seqs, starts, 200, 0.5, 8, seed=4) != chunks
    with pytest.raises(InvalidArgumentError, match="Fix"):
        StreamConfig(anchors_per_token=0)


@pytest.fixture(scope="module")
def corpus(tiny_pair, tmp_path_factory) -> Path:  # noqa: ANN001
    path = tmp_path_factory.mktemp("stream") / "chat.jsonl"
    generate_answers(tiny_pair.target, [f"Tell me about item {i}." for i in range(16)], path, batch_size=8,
                     max_new_tokens=40, threads=1)
    return path


def _argv(tiny_pair, corpus: Path, out: Path, *extra: str) -> list[str]:  # noqa: ANN001
    return ["train-drafter", "--target", str(tiny_pair.target), "--corpus", str(corpus), "--out", str(out),
            "--gamma", "4", "--layers", "0,1", "--num-layers", "1", "--markov-rank", "8", "--draft-vocab", "256",
            "--batch-seqs", "2", "--anchors", "4", "--stream-chunk-tokens", "250", "--anchors-per-token", "0.2",
            "--max-minutes", "30", *extra]


def test_stream_trains_chunk_by_chunk_and_measures_milestones(tiny_pair, corpus, tmp_path,  # noqa: ANN001
                                                               caplog) -> None:  # noqa: ANN001
    from dspark_trt.cli import main

    out = tmp_path / "s"
    assert main(_argv(tiny_pair, corpus, out, "--milestones", "100,100000")) == 0
    rec = json.loads((out / "stream.json").read_text())
    plan = rec["plan"]
    assert plan["chunks"] >= 3 and rec["finished"] and rec["step"] == plan["total_steps"]
    assert [c["index"] for c in rec["chunks"]] == list(range(plan["chunks"])) and all(c["complete"] for c in rec["chunks"])
    assert rec["trained_answer_tokens"] == plan["answer_tokens"]
    assert json.loads((out / "metrics.json").read_text())["steps"] == plan["total_steps"]
    assert [m["answer_tokens"] for m in rec["milestones"]] == [100]  # 100k never reached
    loop = rec["milestones"][0]["loop"]
    assert loop["lossless_mismatches"] == 0 and loop["tau"] >= 1.0
    assert (out / "milestones" / "100" / "drafter" / "config.json").exists()
    assert (out / "drafter" / "config.json").exists()
    # a finished stream resumed: nothing more to train
    assert main(_argv(tiny_pair, corpus, out, "--resume")) == 0
    assert len(json.loads((out / "stream.json").read_text())["chunks"]) == plan["chunks"]
    # the same directory without --resume is refused (it would restart the schedule over the checkpoint)
    caplog.clear()
    assert main(_argv(tiny_pair, corpus, out)) != 0
    assert "Fix: pass --resume" in caplog.text
    # continued elsewhere: the drafter + the step of chunk 1's start → chunk 0 is skipped, the rest trained
    second = plan_chunks_of(tiny_pair, corpus)[1].step_start
    out2 = tmp_path / "s2"
    assert main(_argv(tiny_pair, corpus, out2, "--init-from", str(out / "milestones" / "100" / "drafter"),
                      "--start-step", str(second))) == 0
    rec2 = json.loads((out2 / "stream.json").read_text())
    assert rec2["chunks"][0]["index"] == 1 and rec2["finished"] and rec2["step"] == plan["total_steps"]


def plan_chunks_of(tiny_pair, corpus: Path):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    from dspark_trt.train.corpus import load_corpus
    from dspark_trt.train.trainer import TrainConfig

    seqs, starts = load_corpus([corpus], AutoTokenizer.from_pretrained(tiny_pair.target), 2_000_000,
                               window=TrainConfig().max_len, seed=0)
    return plan_chunks(seqs, starts, 250, 0.2, 8, seed=0)
