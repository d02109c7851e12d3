"""dspark_trt.engine: the deployment guide's API — argument validation, vocabulary check, HF-object conversion, generate."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.engine import SpeculativeDecodingEngine, to_runtime_model
from dspark_trt.errors import InvalidArgumentError, VocabularyMismatchError


@pytest.fixture(scope="module")
def hf_pair(tiny_pair):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return load(tiny_pair.target), load(tiny_pair.draft), AutoTokenizer.from_pretrained(tiny_pair.tokenizer)


@pytest.mark.parametrize("kw, match", [
    ({"max_length": 1}, r"max_length=1 is invalid: max_length must be an integer ≥ 2"),
    ({"draft_length": 0}, r"draft_length=0 .* \[1, 64\]"),
    ({"draft_length": 65}, r"draft_length=65 .* \[1, 64\]"),
    ({"temperature": -0.5}, r"temperature must be a finite number in \[0, 100\] \(0 = greedy\), got -0.5"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\] .*got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\] .*got 1.5"),
    ({"seed": -3}, r"seed must be unset or an integer in \[0, 2\^63 − 1\], got -3"),
    ({"confidence_threshold": 1.0}, r"confidence_threshold=1.0 .* \[0, 1\)"),
    ({"policy": "turbo"}, r"policy='turbo' .* plain, fixed, confidence, survival"),
])
def test_bad_arguments_name_the_argument_and_range(hf_pair, kw, match) -> None:
    target, draft, tok = hf_pair
    with pytest.raises(InvalidArgumentError, match=match):
        SpeculativeDecodingEngine(target_model=target, draft_model=draft, tokenizer=tok, **kw)


def test_vocabulary_mismatch_is_reported(hf_pair) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    target, _, tok = hf_pair
    other = LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2,
                                         eos_token_id=target.config.eos_token_id))
    with pytest.raises(VocabularyMismatchError,
                       match=r"^The draft model and target model must have the same vocabulary: .*draft 600, target 512"):
        SpeculativeDecodingEngine(target_model=target, draft_model=other, tokenizer=tok)


def test_hf_objects_convert_exactly(hf_pair, tiny_pair) -> None:
    from transformers import AutoModelForCausalLM

    for hf in (hf_pair[0], AutoModelForCausalLM.from_pretrained(tiny_pair.qwen2, dtype=torch.float32).eval()):
        rt = to_runtime_model(hf)
        ids = torch.tensor([[5, 100, 200, 33, 7]])
        out = rt(ids, rt.new_cache(1, 16), torch.tensor([0])).logits
        assert torch.allclose(out, hf(ids).logits, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="must be a Hugging Face causal LM"):
        to_runtime_model(42)


def test_a_tokenizers_output_is_a_prompt_and_text_is_refused_by_name(hf_pair) -> None:
    """What a user has in hand after tokenizing — a BatchEncoding (tokenizer(text), apply_chat_template(...,
    return_dict=True)), a [1, n] tensor, a list — generates the same tokens; text, floats or a batch of two get an
    InvalidArgumentError saying what to pass (the loop never sees them)."""
    target, draft, tok = hf_pair
    eng = SpeculativeDecodingEngine(target_model=target, draft_model=draft, tokenizer=tok, max_length=64,
                                    policy="fixed", draft_length=3)
    enc = tok("def main():\n    return", return_tensors="pt")
    ref = eng.generate(enc["input_ids"], max_new_tokens=8, do_sample=False)
    assert eng.generate(enc, max_new_tokens=8, do_sample=False).tolist() == ref.tolist()
    assert eng.generate(enc["input_ids"][0].tolist(), max_new_tokens=8, do_sample=False).tolist() == ref.tolist()
    assert eng.run(tok("def main():\n    return"), 8).tokens == ref[0, enc["input_ids"].shape[1]:].tolist()
    for bad, match in [("def main():", r"input_ids is text .*tokenizer\(text\)\['input_ids'\]"),
                       (torch.tensor([[1.0, 2.0]]), r"input_ids holds torch.float32 values, not token ids"),
                       (torch.tensor([[1, 2], [3, 4]]), r"input_ids=\(2, 2\) is invalid: .*one sequence"),
                       ([], r"input_ids=\(0,\) is invalid"), ([[1, 2], [3]], r"is not token ids")]:
        with pytest.raises(InvalidArgumentError, match=match):
            eng.generate(bad, max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match=r"prompt_ids is text"):
        eng.run("hello", 4)
    with pytest.raises(InvalidArgumentError, match=r"token ids \[9999\] outside the vocabulary"):
        eng.generate([1, 9999], max_new_tokens=4)
