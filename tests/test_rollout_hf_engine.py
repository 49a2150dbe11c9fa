"""The transformers rollout engine on a small random Llama-shaped model (GQA, tied embeddings): greedy parity with
transformers' own ``generate``, n samples per prompt, stop tokens, length limits, seeding, sleep/wake and the
errors of the interface. Log-prob parity with the Megatron actor is in ``test_rollout_logprobs.py``."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from megarl.rollout.base import RolloutEngine, RolloutError, SamplingConfig, check_prompts, state_dict_writer
from megarl.rollout.hf_engine import HFRolloutEngine
from megarl.rollout.sampler import sample_tokens, truncate_top_k_top_p

TINY = ModelSpec("llama", vocab_size=250, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                 head_dim=16, ffn_hidden_size=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 max_position_embeddings=48, pad_token_id=0)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [20, 21, 22, 23], [30, 31], [40, 41, 42, 43, 44]]

pytestmark = pytest.mark.usefixtures("one_thread")


def random_state_dict(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Canonical tensors of a random model whose logits are peaked but not degenerate: embeddings std 0.4
    (logit std ~3), attention and MLP outputs 6x the usual init so the layers, not the last token's own
    (tied) embedding, decide the next token; norms 1 +- 0.1."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in spec.hf_tensor_shapes().items():
        if len(shape) == 1:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name or "lm_head" in name:
            out[name] = 0.4 * torch.randn(shape, generator=g)
        else:
            scale = 6.0 if ("o_proj" in name or "down_proj" in name) else 1.0
            out[name] = scale * torch.randn(shape, generator=g) / shape[1] ** 0.5
    return out


def loaded_engine(spec: ModelSpec, state_dict, rank: int = 0, **kwargs) -> HFRolloutEngine:
    engine = HFRolloutEngine(spec, **kwargs)
    engine.update_weights(state_dict_writer(state_dict, engine.weight_layout([rank]), rank))
    return engine


def pick_stop_token(outputs) -> int:
    """A token sampled in some but not all responses of every output (the most balanced one), so that a run
    with it as a stop token has both stopped and length-truncated samples."""
    def frac(out, t):
        return sum(t in s.token_ids for s in out.samples) / len(out.samples)

    tokens = {t for out in outputs for s in out.samples for t in s.token_ids}
    best = max(tokens, key=lambda t: min(min(frac(o, t), 1 - frac(o, t)) for o in outputs))
    assert all(0 < frac(o, best) < 1 for o in outputs), "random model: no token splits the samples"
    return best


@pytest.fixture(scope="module")
def weights():
    return random_state_dict(TINY, seed=0)


@pytest.fixture(scope="module")
def engine(weights):
    return loaded_engine(TINY, weights, max_batch_size=4)


def test_engine_follows_the_protocol_and_its_params_are_the_hf_layout(engine):
    assert isinstance(engine, RolloutEngine)
    layout = engine.weight_layout([0, 1])
    params = dict(engine.model.named_parameters())
    assert set(params) == set(layout.tensors(1)) == set(TINY.hf_tensor_shapes())
    assert "lm_head.weight" not in params  # tied: the output layer is the embedding
    assert engine.model.lm_head.weight is params["model.embed_tokens.weight"]
    untied = HFRolloutEngine(TINY.replace(tie_word_embeddings=False))
    assert set(dict(untied.model.named_parameters())) == set(untied.weight_layout([0]).canonical)
    assert "lm_head.weight" in untied.weight_layout([0]).canonical


def test_update_weights_writes_the_state_dict_in_place(engine, weights):
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], weights[n]) for n in params)
    seen = {}
    fresh = HFRolloutEngine(TINY)
    assert fresh.update_weights(lambda tensors: seen.update(tensors) or "stats") == "stats"
    assert all(t.data_ptr() == p.data_ptr() for t, p in zip(seen.values(), fresh.model.parameters()))


def test_greedy_equals_transformers_generate_and_is_deterministic(engine):
    sampling = SamplingConfig(temperature=0, max_new_tokens=12)
    first = engine.generate(PROMPTS, sampling)
    stop = first.samples[1].token_ids[4]  # a token greedy decoding does produce: some rows stop on it
    sampling = SamplingConfig(temperature=0, max_new_tokens=12, stop_token_ids=(stop,))
    out = engine.generate(PROMPTS, sampling)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in engine.generate(PROMPTS, sampling).samples]

    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        ref = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                    eos_token_id=stop, pad_token_id=0)[:, width:]
    reasons = set()
    for s, row in zip(out.samples, ref.tolist()):
        expected = row[:row.index(stop) + 1] if stop in row else row
        assert list(s.token_ids) == expected
        reasons.add(s.finish_reason)
        assert s.finish_reason == ("stop" if stop in row else "length")
        assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == (len(s.token_ids),)
        assert bool((s.logprobs <= 0).all())
    assert reasons == {"stop", "length"}


def test_n_samples_are_grouped_by_prompt_and_seeded(weights):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    engine = loaded_engine(TINY, weights)
    out = engine.generate(PROMPTS, sampling)
    assert out.n == 3 and out.num_prompts == len(PROMPTS) and len(out.samples) == 3 * len(PROMPTS)
    for k in range(len(PROMPTS)):
        group = out.group(k)
        assert [(s.prompt_index, s.sample_index) for s in group] == [(k, 0), (k, 1), (k, 2)]
    assert len({s.token_ids for s in out.samples}) > len(PROMPTS)  # samples of a prompt differ

    # The same seed and call counter give the same samples (a fresh engine), another seed others.
    again = loaded_engine(TINY, weights)
    assert [s.token_ids for s in again.generate(PROMPTS, sampling).samples] == [s.token_ids for s in out.samples]
    other = loaded_engine(TINY, weights)
    reseeded = other.generate(PROMPTS, SamplingConfig(n=3, temperature=1.0, max_new_tokens=10, seed=8))
    assert [s.token_ids for s in reseeded.samples] != [s.token_ids for s in out.samples]
    # The next call of the same engine draws new samples.
    assert [s.token_ids for s in engine.generate(PROMPTS, sampling).samples] != [s.token_ids for s in out.samples]


def test_samples_do_not_depend_on_batching_or_sharding(weights):
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=10, seed=3)
    whole = loaded_engine(TINY, weights, max_batch_size=64).generate(PROMPTS, sampling)
    one_row = loaded_engine(TINY, weights, max_batch_size=1).generate(PROMPTS, sampling)
    shard = loaded_engine(TINY, weights, max_batch_size=3).generate(PROMPTS[2:], sampling, prompt_offset=2)
    assert [s.token_ids for s in one_row.samples] == [s.token_ids for s in whole.samples]
    assert [s.token_ids for s in shard.samples] == [s.token_ids for s in whole.samples[4:]]
    assert [s.prompt_index for s in shard.samples] == [s.prompt_index for s in whole.samples[4:]]
    for a, b in zip(one_row.samples, whole.samples):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_stop_tokens_and_length_limits(weights):
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=14, seed=5)
    free = loaded_engine(TINY, weights).generate(PROMPTS, sampling)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 14 for s in free.samples)
    stop = pick_stop_token([free])
    # The model's EOS (spec) and a sampling stop token both end a response, keeping the stop token.
    for spec, cfg in ((TINY.replace(eos_token_ids=(stop,)), sampling),
                      (TINY, SamplingConfig(n=2, temperature=1.0, max_new_tokens=14, seed=5, stop_token_ids=(stop,)))):
        out = loaded_engine(spec, weights).generate(PROMPTS, cfg)
        for s, f in zip(out.samples, free.samples):
            if stop in f.token_ids:
                end = f.token_ids.index(stop) + 1
                assert s.token_ids == f.token_ids[:end] and s.finish_reason == "stop"
                torch.testing.assert_close(s.logprobs, f.logprobs[:end], atol=1e-5, rtol=0)
            else:
                assert s.token_ids == f.token_ids and s.finish_reason == "length"
        ids, logprobs, lengths = out.padded(pad_token_id=0)
        assert ids.shape == logprobs.shape == (len(out.samples), int(lengths.max()))
        assert lengths.tolist() == [len(s.token_ids) for s in out.samples]
        assert float(logprobs[lengths.unsqueeze(1) <= torch.arange(ids.shape[1])].abs().sum()) == 0

    # The context length cuts a response too: 48 - 45 = 3 tokens.
    out = loaded_engine(TINY, weights).generate([list(range(1, 46))], SamplingConfig(max_new_tokens=10))
    assert len(out.samples[0].token_ids) == 3 and out.samples[0].finish_reason == "length"


def test_top_k_top_p_truncate_sampling_but_not_the_reported_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    assert torch.isinf(truncate_top_k_top_p(logits, 2, 1.0)).tolist() == [[False, True, True, True, False]]
    p = logits.softmax(-1)[0]  # sorted: 0.636 (index 4), 0.234 (0), 0.086 (1), ...
    kept = ~torch.isinf(truncate_top_k_top_p(logits, -1, float(p[4] + p[0]) - 1e-4))
    assert kept.tolist() == [[True, False, False, False, True]]
    assert truncate_top_k_top_p(logits, -1, 0.1).isfinite().sum() == 1  # the top token is always kept
    assert truncate_top_k_top_p(logits, -1, 1.0) is logits

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    sampling = SamplingConfig(temperature=0.5, top_k=3)
    tokens, logprobs = sample_tokens(logits, sampling, gens)
    assert bool((logits.gather(1, tokens[:, None]) >= logits.topk(3).values[:, 2:]).all())
    assert len(set(tokens.tolist()) - set(logits.argmax(-1).tolist())) > 0  # not greedy
    expected = (logits / 0.5).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)  # full-vocab tempered log-probs, not renormalised
    greedy, greedy_lp = sample_tokens(logits, SamplingConfig(temperature=0), [])
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(greedy_lp, logits.log_softmax(-1).max(-1).values)


def test_sleep_and_wake_up(weights):
    engine = loaded_engine(TINY, weights)
    greedy = SamplingConfig(temperature=0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy)
    engine.sleep()
    with pytest.raises(RolloutError, match="wake_up"):
        engine.generate(PROMPTS, greedy)
    engine.wake_up()
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy).samples] == [s.token_ids for s in before.samples]
    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(RolloutError, match="wake_up"):
        engine.update_weights(state_dict_writer(weights, engine.weight_layout([0]), 0))
    engine.wake_up()
    with pytest.raises(RolloutError, match="update_weights"):
        engine.generate(PROMPTS, greedy)
    engine.update_weights(state_dict_writer(weights, engine.weight_layout([0]), 0))
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy).samples] == [s.token_ids for s in before.samples]
    with pytest.raises(RolloutError, match="sleep level"):
        engine.sleep(level=3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=0), "sampling.n"),
    (dict(temperature=-0.1), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=0), "sampling.top_k"),
    (dict(max_new_tokens=0), "sampling.max_new_tokens"),
    (dict(stop_token_ids=(-1,)), "sampling.stop_token_ids"),
])
def test_bad_sampling_configs(kwargs, match):
    with pytest.raises(RolloutError, match=match):
        SamplingConfig(**kwargs)


def test_bad_prompts_and_states(engine, weights):
    sampling = SamplingConfig()
    with pytest.raises(RolloutError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], sampling)
    with pytest.raises(RolloutError, match=r"prompt 2 has 48 tokens.*context of 48 tokens.*at most 47"):
        engine.generate([[1], [2], list(range(48))], sampling)
    with pytest.raises(RolloutError, match=r"prompt 0 has token ids outside the vocab \[0, 250\): \[250\]"):
        engine.generate([[1, 250]], sampling)
    assert check_prompts([(1, 2)], max_context=3, vocab_size=5) == [[1, 2]]
    assert engine.generate([], sampling).samples == []
    with pytest.raises(RolloutError, match="update_weights"):
        HFRolloutEngine(TINY).generate(PROMPTS, sampling)
    with pytest.raises(RolloutError, match="max_batch_size"):
        HFRolloutEngine(TINY, max_batch_size=0)
    with pytest.raises(SpecError, match="no tensor"):
        HFRolloutEngine(TINY).update_weights(state_dict_writer(
            {n: t for n, t in weights.items() if "norm" not in n}, engine.weight_layout([0]), 0))


def test_a_gated_deltanet_hybrid_samples_what_its_transformers_model_scores():
    """Qwen3.5 (gated DeltaNet layers beside attention ones: its cache holds convolution and recurrent states):
    n samples of left-padded prompts sharing their prompt's prefill, rows leaving the batch on a stop token, and
    each sample's reported log-probs equal to the transformers model's own, teacher-forced over the sample's
    unpadded tokens without a cache."""
    from tests.test_models_qwen3_5 import QWEN35

    weights = random_state_dict(QWEN35, seed=0)
    prompts = PROMPTS[:4]
    first = loaded_engine(QWEN35, weights).generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=8,
                                                                            seed=1))
    engine = loaded_engine(QWEN35, weights, max_batch_size=4)  # a fresh one: the same seeds as the first call
    out = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=1,
                                                  stop_token_ids=(pick_stop_token([first]),)))
    assert {s.finish_reason for s in out.samples} == {"stop", "length"}
    for s in out.samples:
        prompt = prompts[s.prompt_index]
        ids = torch.tensor([prompt + list(s.token_ids)])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs, want, atol=1e-4, rtol=0)
