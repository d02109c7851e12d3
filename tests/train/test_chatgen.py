"""train.chatgen on the tiny target: continuous batching (batched prefill of refilled slots, one batched decode
step) writes exactly each prompt's greedy answer alone; multi-turn items; a rerun resumes without repeats."""
from __future__ import annotations

import json

import torch

from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer
from dspark_trt.runtime.model import greedy_decode
from dspark_trt.train.chatgen import chat_prompt_ids, generate_answers, greedy_ids, item_key


def _items() -> list:
    singles = [f"Question {i}: " + "tell me about tokens " * (i % 4 + 1) for i in range(9)]
    convo = ({"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": "Explain it again, shorter."})
    return singles[:5] + [convo] + singles[5:]


def test_batched_generation_equals_each_prompt_alone_and_resumes(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    items, out = _items(), tmp_path / "chat.jsonl"
    n = generate_answers(tiny_pair.target, items[:4], out, batch_size=3, max_new_tokens=12, threads=1)
    assert n == 4
    n = generate_answers(tiny_pair.target, items, out, batch_size=3, max_new_tokens=12, threads=1)  # resumes
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == len(items) == len(recs) and sorted(r["prompt"] for r in recs) == sorted(map(item_key, items))

    tok = load_tokenizer(tiny_pair.target)
    model = load_hf_checkpoint(tiny_pair.target, dtype=torch.bfloat16)
    eos = set(model.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    by_key = {r["prompt"]: r for r in recs}
    for item in items:
        ids = chat_prompt_ids(tok, item)
        rec = by_key[item_key(item)]
        assert rec["ids"][:rec["prompt_len"]] == ids
        alone = greedy_decode(model, ids, 12)
        cut = next((i + 1 for i, t in enumerate(alone) if t in eos), len(alone))
        assert rec["ids"][rec["prompt_len"]:] == alone[:cut], item_key(item)


def test_multi_turn_items_use_the_chat_template_and_store_their_messages_as_json(tiny_pair) -> None:  # noqa: ANN001
    tok = load_tokenizer(tiny_pair.target)
    convo = _items()[5]
    ids = chat_prompt_ids(tok, convo)
    text = tok.decode(ids)
    at = [text.index(m["content"]) for m in convo]  # every turn, in order
    assert at == sorted(at) and text.count("Hello! How can I help?") == 1
    assert len(ids) > len(chat_prompt_ids(tok, convo[-1]["content"]))
    assert json.loads(item_key(convo)) == list(convo) and item_key("plain") == "plain"


def test_greedy_ids_is_the_first_maximum_as_argmax() -> None:
    x = torch.randn(7, 300).bfloat16()
    x[3, 10] = x[3, 200] = 50.0  # a tie: the first index wins, as torch.argmax
    assert greedy_ids(x) == x.float().argmax(-1).tolist() and greedy_ids(x)[3] == 10
