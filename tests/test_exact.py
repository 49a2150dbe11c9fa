"""``rollout.exact`` on the CPU (issue 46): the combinations that cannot be exact refused with one ``megarl:
error:`` line before anything starts; the trainer's old-log-prob pass batch-invariant (a sample's log-probs do
not depend on the other samples of its batch, the micro-batch size or the padding), bit for bit; vLLM's kernels
wired into megatron's layers (:func:`megarl.kernels.batch_invariant.vllm_kernels`, with torch functions in their
place here); and two seeded runs on the transformers engine giving the same log-probs and metrics. The GPU half
(trainer == vLLM bit for bit) is tests/test_gpu_exact.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, make_tiny_moe_model, task_overrides, train_on_rank, write_prompts
from tests.test_bad_input import run_cli  # noqa: F401  (fixture: main(argv) with every launcher replaced)

# Hidden 128 and a 7-token log-prob chunk: sizes at which the plain pass is NOT batch-invariant on the CPU (MKL's
# sgemm of a few rows rounds otherwise than of many: the chunks of the output layer cut the micro-batch's tokens
# at places that move with its rows; measured: up to 9.5e-7 apart at micro-batch size 4).
SPEC = ModelSpec("llama", 512, 128, 2, 8, 2, 16, 512, tie_word_embeddings=False, max_position_embeddings=256,
                 eos_token_ids=(1,))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """A torch stand-in for vLLM's ``silu_and_mul``: ``[..., 2 f]`` (gate, up) -> ``[..., f]``."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A torch stand-in for vLLM's ``rms_norm_batch_invariant`` (without a residual)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A torch stand-in for the exact pass's FlashAttention: one sequence ``[s, n, d]``, grouped KV heads."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama, its prompts, a tiny MoE model and the Llama as a Mistral with an 8-token window."""
    root = tmp_path_factory.mktemp("exact")
    model = make_tiny_model(root / "model")
    windowed = root / "windowed"
    shutil.copytree(model, windowed)
    cfg = json.loads((windowed / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    (windowed / "config.json").write_text(json.dumps(cfg))
    return model, write_prompts(root / "prompts.jsonl", 8), make_tiny_moe_model(root / "moe"), windowed


REFUSALS = [  # (overrides beside rollout.exact=true, what the one error line must say)
    (["rollout.engine=vllm", "rollout.quantization=fp8", "model.dtype=bfloat16"],
     "rollout.quantization: fp8 rollouts cannot be exact"),
    (["rollout.engine=vllm", "rollout.kv_cache_dtype=fp8", "model.dtype=bfloat16"],
     "rollout.kv_cache_dtype: fp8 cannot be exact"),
    (["rollout.engine=vllm", "rollout.tp=2", "model.dtype=bfloat16"], "rollout.tp: 2 cannot be exact yet"),
    (["rollout.engine=vllm", "rollout.model_runner=v2", "model.dtype=bfloat16"],
     "rollout.model_runner: v2 cannot be exact yet"),
    (["rollout.engine=vllm"], "model.dtype: float32 cannot be exact with rollout.engine=vllm"),
    (["actor.parallel.tp=2"], "actor.parallel.tp: 2 cannot be exact yet"),
    (["actor.parallel.pp=2"], "actor.parallel.pp: 2 cannot be exact yet"),
    (["actor.parallel.cp=2"], "actor.parallel.cp: 2 cannot be exact"),
    (["actor.max_tokens_per_micro_batch=64", "actor.sequence_packing=true"], "actor.sequence_packing: cannot be exact"),
    (["actor.kernels.transformer_engine=true"], "actor.kernels.transformer_engine: cannot be exact"),
    (["rollout.engine=vllm", "model.dtype=bfloat16", "actor.kernels.attention=local"],
     "actor.kernels.attention: 'local' cannot be exact with rollout.engine=vllm"),
    (["actor.lora.rank=8"], "actor.lora.rank: 8 cannot be exact"),
    (["trainer.mode=async"], "trainer.mode: async generates with the weights of an earlier step"),
    (["MOE"], "rollout.exact: a qwen3_moe model (mixture of experts) cannot be exact yet"),
    (["WINDOWED", "rollout.engine=vllm", "model.dtype=bfloat16"],
     "rollout.exact: a sliding window of 8 tokens is not wired into the exact pass"),
]


@pytest.mark.parametrize("extra,says", REFUSALS, ids=[f"{r[1].split(':')[0]}-{i}" for i, r in enumerate(REFUSALS)])
def test_what_cannot_be_exact_is_refused_before_anything_starts(tiny, run_cli, extra, says):
    model, data, moe, windowed = tiny
    extra = [{"MOE": f"model.path={moe}", "WINDOWED": f"model.path={windowed}"}.get(e, e) for e in extra]
    status, err = run_cli(["train", *task_overrides(model, data, "runs", "exact"), "rollout.exact=true", *extra])
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("megarl: error: " + says), lines[0]
    assert lines[0].endswith("or rollout.exact=false"), lines[0]  # and the way out


def test_an_old_gpu_is_refused_for_exact_vllm(monkeypatch):
    """vLLM 0.24's batch-invariant mode needs compute capability 8.0 (its SM80 Triton path) or newer."""
    import importlib.util

    from megarl.config import ConfigError, load_config
    from megarl.trainer import preflight

    cfg = load_config(None, ["rollout.engine=vllm", "model.dtype=bfloat16", "rollout.exact=true"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(ConfigError, match=r"^rollout.exact: .* compute capability 8.0 or newer .* this one is 7.5"):
        preflight.check_this_machine(cfg)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    preflight.check_this_machine(cfg)  # an H100 passes
    cfg.rollout.exact = False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    preflight.check_this_machine(cfg)  # and without exact the old GPU is not this check's business


def test_the_vllm_engine_starts_in_batch_invariant_mode_with_exact_only():
    """``rollout.exact`` reaches the engine's settings and from there the variables vLLM reads when it starts
    (``VLLM_BATCH_INVARIANT=1``; cuBLAS without split-K), which the standalone baseline's child gets too."""
    from megarl.config import load_config
    from megarl.rollout.vllm_engine import VLLMSettings

    on = VLLMSettings.from_config(load_config(None, ["rollout.engine=vllm", "model.dtype=bfloat16",
                                                     "rollout.exact=true"]).rollout)
    assert on.exact and on.environment()["VLLM_BATCH_INVARIANT"] == "1"
    assert on.environment()["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # V1's sampler, whatever the architecture
    assert on.environment()["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and on.as_dict()["exact"] is True
    off = VLLMSettings.from_config(load_config(None, ["rollout.engine=vllm"]).rollout)
    assert not off.exact and "VLLM_BATCH_INVARIANT" not in off.environment()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in off.environment()  # vLLM's choice
    assert "VLLM_USE_V2_MODEL_RUNNER" not in off.environment("LlamaForCausalLM")  # vLLM's choice: V2 already
    assert off.environment("Qwen2ForCausalLM")["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # vLLM's is V1; V2 measured faster
    assert on.environment("Qwen2ForCausalLM")["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # exact: V1's sampler
    v1 = VLLMSettings.from_config(load_config(None, ["rollout.engine=vllm", "rollout.model_runner=v1"]).rollout)
    assert v1.environment("Qwen2ForCausalLM")["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # asked for
    from megarl.rollout.vllm_engine import llm_kwargs

    def custom_ops(settings, eager):  # compiled exact engines keep vLLM's custom (batch-invariant) ops
        return llm_kwargs(settings, model_dir="m", context=64, seed=0, enforce_eager=eager,
                          gpu_memory_utilization=0.3).get("compilation_config", {}).get("custom_ops")
    assert custom_ops(on, False) == ["all"] and custom_ops(on, True) is None and custom_ops(off, False) is None
    from megarl.kernels.batch_invariant import EXACT_KV_BLOCK_SIZE

    def block_size(settings):  # the exact engine's KV page is the one the trainer's exact attention reads through
        return llm_kwargs(settings, model_dir="m", context=64, seed=0, enforce_eager=True,
                          gpu_memory_utilization=0.3).get("block_size")
    assert block_size(on) == EXACT_KV_BLOCK_SIZE and block_size(off) is None


def test_paged_kv_holds_a_sequence_as_vllms_cache_does():
    """The exact attention's keys and values in vLLM's paged layout: reading the pages through the block table
    gives the sequence back, the padding of the last page is zero and ``seqused_k`` is the length."""
    from megarl.kernels.batch_invariant import paged_kv

    k, v = torch.randn(37, 2, 8), torch.randn(37, 2, 6)
    k_cache, v_cache, table, used = paged_kv(k, v, block_size=16)
    assert k_cache.shape == (3, 16, 2, 8) and v_cache.shape == (3, 16, 2, 6) and table.dtype == torch.int32
    assert used.tolist() == [37] and table.tolist() == [[0, 1, 2]]
    for cache, x in ((k_cache, k), (v_cache, v)):
        read = cache[table[0].long()].reshape(-1, *x.shape[1:])
        assert torch.equal(read[:37], x) and not read[37:].any()


def test_vllm_logprobs_cut_the_padded_vocab_and_divide_by_the_temperature():
    """The exact pass's log-probs as vLLM's V1 sampler takes them, against float64: the padding columns (here huge
    logits, which would take all the mass) are cut, then ``log_softmax(logits / T)`` at the labels."""
    from megarl.kernels.batch_invariant import vllm_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 72, generator=g) * 3).bfloat16()
    logits[..., 64:] = 100.0
    labels = torch.randint(0, 64, (2, 5), generator=g)
    got = vllm_logprobs(logits, labels, vocab_size=64, temperature=0.7)
    want = torch.log_softmax(logits[..., :64].double() / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=0, atol=1e-5)


def _batch(rows, seq_multiple=8):
    from megarl.data.batch import build_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(2, 512, (int(torch.randint(1, 100, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(8)]
    return build_batch([prompts[i] for i in rows], [responses[i] for i in rows],
                       [torch.zeros(len(responses[i])) for i in rows], list(range(len(rows))), pad_token_id=0,
                       seq_multiple=seq_multiple)


def _passes(rank, world, exact):
    """Each sample's log-probs (its valid columns) from the old-log-prob pass of batches that put it among other
    samples, alone, in another order, with more padding, at micro-batch sizes 1 and 4; then the patched layers of
    :func:`vllm_kernels` with torch functions against the plain forward."""
    from megarl.config import ActorConfig, KernelsConfig
    from megarl.kernels.batch_invariant import vllm_kernels
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    initialize_model_parallel(ParallelLayout(), seed=0)
    out: dict[str, list[torch.Tensor]] = {}
    workers = []
    for mb in (1, 4):
        rc = ActorConfig(micro_batch_size=mb, ppo_mini_batch_size=8, kernels=KernelsConfig(logprob_chunk_tokens=7))
        w = PolicyWorker(SPEC, ParallelLayout(), "actor", workers[0] if workers else "preset:random", torch.float32,
                         rc, trainable=False, temperature=0.9)
        workers.append(w)
        pads = (8, 64) if mb == 1 else (64, 8)  # columns padded to a multiple of 8, or of 64
        for name, rows, multiple in (("together", list(range(8)), pads[0]), ("reversed", list(range(7, -1, -1)),
                                                                           pads[1])):
            b = _batch(rows, multiple)
            lp = w.compute_logprobs(b, exact=exact)["logprobs"]
            out[f"mb{mb}-{name}-pad{multiple}"] = [lp[rows.index(i), :int(b["response_lens"][rows.index(i)])]
                                                   for i in range(8)]
    out["alone"] = [workers[0].compute_logprobs(_batch([i]), exact=exact)["logprobs"][0,
                    :int(_batch([i])["response_lens"][0])] for i in range(8)]
    w, b = workers[0], _batch(range(8))
    plain = w.compute_logprobs(b)["logprobs"]

    with vllm_kernels(w.chunks, torch.nn.functional.linear, rms_norm, swiglu, causal_attention) as rerouted:
        routed = w.compute_logprobs(b)["logprobs"]
    zero = lambda x, weight, bias: torch.zeros(*x.shape[:-1], weight.shape[0])  # noqa: E731
    with vllm_kernels(w.chunks, zero, rms_norm, swiglu, causal_attention):
        zeroed = w.compute_logprobs(b)["logprobs"]
    restored = w.compute_logprobs(b)["logprobs"]
    mask = b["response_mask"].bool()
    return out, {"rerouted": rerouted, "routed_vs_plain": (routed - plain)[mask].abs().max().item(),
                 "zeroed_vs_plain": (zeroed - plain)[mask].abs().max().item(), "restored": torch.equal(restored, plain)}


def test_the_exact_old_logprob_pass_is_batch_invariant_bit_for_bit():
    """Fails without ``exact`` (the plain pass of these sizes gives a sample other bits among other samples)."""
    out, routed = run_world(_passes, 1, True)[0]
    reference = out.pop("alone")
    for name, lps in out.items():
        for i, (got, want) in enumerate(zip(lps, reference)):
            assert torch.equal(got, want), f"{name}: sample {i} differs by {(got - want).abs().max().item():.3g}"
    # vllm_kernels reroutes every linear layer (4 a layer, the output layer), RMSNorm (2 a layer, the final one),
    # MLP and core attention (1 a layer each)
    assert routed["rerouted"] == 2 * 4 + 1 + 2 * 2 + 1 + 2 + 2
    assert routed["routed_vs_plain"] < 1e-5 and routed["zeroed_vs_plain"] > 1e-2 and routed["restored"]


@pytest.mark.slow  # two training runs: ~1 min on 2 free cores
def test_two_seeded_exact_runs_on_the_transformers_engine_match(tmp_path, tiny):
    """The same seed and config twice: every sample's tokens and rollout log-probs, the trainer's old log-probs and
    so every metric but the timings come out identical; ``rollout/exact`` and ``mismatch/exact_tokens_frac`` are
    logged (the transformers engine and megatron are other implementations: their log-probs differ slightly)."""
    model, data, _, _ = tiny
    runs = []
    for name in ("a", "b"):
        overrides = [*task_overrides(model, data, tmp_path, name), "rollout.exact=true", "trainer.steps=2",
                     "rollout.n=4", "data.prompts_per_step=2", "actor.ppo_mini_batch_size=8", "trainer.save_every=0"]
        runs.append(run_world(train_on_rank, 1, overrides)[0])
    timing = ("time/", "throughput/", "perf/", "memory/", "pool/")  # seconds, rates and busy/idle shares
    for a, b in zip(*runs):
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and not k.startswith(timing))
        assert not diff, f"step {a['step']}: the two runs differ in {[(k, a.get(k), b.get(k)) for k in diff]}"
    assert len(runs[0]) == len(runs[1]) == 2
    assert all(step["rollout/exact"] == 1.0 and 0.0 <= step["mismatch/exact_tokens_frac"] <= 1.0 for step in runs[0])


def _tied_logits(rank, world):
    """A tied model's logits (the output layer takes the embedding as its ``weight``), plain and through
    :func:`vllm_kernels` with torch functions."""
    from megarl.kernels.batch_invariant import vllm_kernels
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from tests.actor_decoding import actor_logits

    initialize_model_parallel(ParallelLayout(), seed=0)
    model = build_model(SPEC.replace(tie_word_embeddings=True), ParallelLayout(), attention="sdpa").eval()
    ids = list(range(2, 30))
    plain = actor_logits(model, ids)

    with vllm_kernels([model], torch.nn.functional.linear, rms_norm, swiglu, causal_attention):
        routed = actor_logits(model, ids)
    return (routed - plain).abs().max().item()


def test_the_exact_pass_takes_a_tied_output_layers_weight_from_the_embedding():
    """Fails when the rerouted output layer reads its own ``weight`` (None when tied) instead of the one passed."""
    assert run_world(_tied_logits, 1)[0] < 1e-5


def test_vllm_rotary_rounds_once_as_vllms_kernel_where_megatrons_rotation_rounds_thrice():
    """vLLM 0.24's ``rotary_embedding`` op (bf16 cos/sin cache, ``x cos - y sin`` in float32, one rounding) against
    a float64 formula of it, bit for bit; megatron's own rotation (each product and the sum rounded to bf16)
    differs from it, which is what put the GPU probe's first difference at q and k after RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megarl.kernels.batch_invariant import vllm_rotary

    g = torch.Generator().manual_seed(0)
    s, heads, d = 64, 4, 32
    t = (torch.randn(s, 1, heads, d, generator=g) * 3).to(torch.bfloat16)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    half = torch.outer(torch.arange(s, dtype=torch.float), inv_freq)
    freqs = torch.cat((half, half), dim=-1)[:, None, None, :]  # megatron's RotaryEmbedding output [s, 1, 1, d]

    cos, sin = (f(half).to(torch.bfloat16).double()[:, None, None, :] for f in (torch.cos, torch.sin))
    x, y = t.double().chunk(2, dim=-1)
    want = torch.cat((x * cos - y * sin, y * cos + x * sin), dim=-1).float().to(torch.bfloat16)

    got = vllm_rotary(t, freqs, config=None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    megatrons = _apply_rotary_pos_emb_bshd(t, freqs)
    assert (megatrons != want).sum() > 0.01 * want.numel()
    with pytest.raises(ValueError, match="NeoX-style"):
        vllm_rotary(t, freqs, config=None, cu_seqlens=torch.tensor([0, s]))


def _routed_calls(rank, world):
    """Which function megatron's attention and norms call under :func:`vllm_kernels` in one forward (torch
    stand-ins that count), whether megatron's rotation is back afterwards, and how far the logits moved."""
    from megatron.core.transformer import attention as megatron_attention

    from megarl.kernels.batch_invariant import vllm_kernels, vllm_rotary
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from tests.actor_decoding import actor_logits

    initialize_model_parallel(ParallelLayout(), seed=0)
    model = build_model(SPEC, ParallelLayout(), attention="sdpa").eval()
    before = megatron_attention.apply_rotary_pos_emb
    calls = {"rotary": 0, "norm": 0, "swiglu": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    ids = list(range(2, 30))
    plain = actor_logits(model, ids)
    with vllm_kernels([model], torch.nn.functional.linear, counted("norm", rms_norm), counted("swiglu", swiglu),
                      causal_attention, counted("rotary", vllm_rotary)):
        routed = actor_logits(model, ids)
    return calls, megatron_attention.apply_rotary_pos_emb is before, (routed - plain).abs().max().item()


def test_the_exact_pass_rotates_normalises_and_gates_with_the_given_kernels():
    """RoPE (q and k of each layer) goes through ``rotary``, each MLP's activation through ``silu_and_mul`` and
    every norm (two a layer, the final one) through ``rms_norm``. Fails when any is left to megatron or megatron's
    rotation is not put back."""
    calls, restored, diff = run_world(_routed_calls, 1)[0]
    layers = SPEC.num_layers
    assert calls == {"rotary": 2 * layers, "norm": 2 * layers + 1, "swiglu": layers}
    assert restored and diff < 1e-5


def test_residual_then_norm_adds_in_the_inputs_dtype_then_normalises_the_sum():
    """The norm exact mode puts in vLLM's RMSNorm (in place of the fused add + norm CUDA op, whose reduction order
    follows the step's token count in vLLM 0.24): with a residual, ``(norm(x + residual), x + residual)`` with
    the sum rounded to bf16 as megatron's residual add rounds it; without, ``norm(x)``; and marked, so that a
    second :func:`enable_batch_invariant_mode` does not wrap it twice."""
    from megarl.kernels.batch_invariant import residual_then_norm

    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = torch.rand(64, generator=g).to(torch.bfloat16)

    def norm(t, w, eps):
        return torch.nn.functional.rms_norm(t.float(), (t.shape[-1],), w.float(), eps).to(t.dtype)

    wrapped = residual_then_norm(norm)
    out, total = wrapped(x, weight, 1e-6, residual=residual)
    assert total.dtype == torch.bfloat16 and torch.equal(total, (x.float() + residual.float()).to(torch.bfloat16))
    assert torch.equal(out, norm(total, weight, 1e-6))
    assert torch.equal(wrapped(x, weight, 1e-6), norm(x, weight, 1e-6))
    assert wrapped.adds_the_residual_first


def test_fixed_attention_tile_raises_the_query_bound_and_nothing_else():
    """vLLM's FlashAttention call with ``max_seqlen_q`` raised to the prefill tile's floor, given as a keyword (as
    vLLM's backend passes it) or positionally; a larger bound and every other argument pass unchanged. Without it
    FA3 runs a decode step (max_seqlen_q 1) of head_dim 64 on a 192-key tile and a prefill on a 128-key one."""
    from megarl.kernels.batch_invariant import EXACT_MIN_QUERY_LEN, fixed_attention_tile

    calls = []
    fixed = fixed_attention_tile(lambda *args, **kwargs: calls.append((args, kwargs)))
    fixed("q", "k", "v", max_seqlen_q=1, cu_seqlens_q="cu", causal=True)
    fixed("q", "k", "v", 300, "cu", causal=True)
    fixed("q", "k", "v", max_seqlen_q=EXACT_MIN_QUERY_LEN + 5)
    assert calls == [(("q", "k", "v"), {"max_seqlen_q": EXACT_MIN_QUERY_LEN, "cu_seqlens_q": "cu", "causal": True}),
                     (("q", "k", "v", 300, "cu"), {"causal": True}),
                     (("q", "k", "v"), {"max_seqlen_q": EXACT_MIN_QUERY_LEN + 5})]
    assert fixed.fixes_the_tile and EXACT_MIN_QUERY_LEN * 1 > 64  # above one MMA warp group's bound for any GQA


def _shared_micro_batches(rank, world):
    """The exact pass with vLLM's kernels (torch stand-ins here, batch-invariant mode faked on): several rows to a
    micro-batch within the logit budget, every row once; its log-probs against the CPU's one-sample path."""
    import functools

    import megarl.workers.actor as actor_module
    import megarl.workers.engine as engine_module
    from megarl.config import ActorConfig, KernelsConfig
    from megarl.kernels.batch_invariant import vllm_kernels
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker
    from megarl.workers.engine import MODEL_INPUTS

    mesh = ParallelLayout(dp=world)
    initialize_model_parallel(mesh, seed=0)
    rc = ActorConfig(micro_batch_size=4, ppo_mini_batch_size=8, kernels=KernelsConfig(logprob_chunk_tokens=7))
    w = PolicyWorker(SPEC, mesh, "actor", "preset:random", torch.float32, rc, trainable=False, temperature=0.9)
    b = _batch(range(8))
    alone = w.compute_logprobs(b, exact=True)["logprobs"]

    budget_tokens = 160
    engine_module.EXACT_LOGIT_BYTES = budget_tokens * 4 * SPEC.vocab_size
    engine_module.batch_invariant_mode = actor_module.batch_invariant_mode = lambda: True
    engine_module.vllm_kernels = functools.partial(vllm_kernels, linear=torch.nn.functional.linear, rms_norm=rms_norm,
                                                   silu_and_mul=swiglu, attention=causal_attention)
    micro, rows = w._exact_micro_batches(b, MODEL_INPUTS)
    shared = w.compute_logprobs(b, exact=True)["logprobs"]
    mask = b["response_mask"].bool()
    return {"rows": [len(m["input_ids"]) for m in micro], "tokens": [m["input_ids"].numel() for m in micro],
            "order": sorted(torch.cat(rows).tolist()), "diff": (shared - alone)[mask].abs().max().item()}


@pytest.mark.parametrize("dp", [1, 2])
def test_the_exact_pass_shares_micro_batches_where_vllms_kernels_are_batch_invariant(dp):
    """On the GPU (vLLM's batch-invariant mode) the exact pass runs rows of similar length together, at most
    EXACT_LOGIT_BYTES of float32 logits a micro-batch, not one sample at a time (8 s against 0.2 s a step for
    SmolLM2's 128 samples on an H100); the rows come back in the batch's order, over DP ranks too (a mix-up would
    move log-probs by far more than the tolerance)."""
    r = run_world(_shared_micro_batches, dp)[0]
    assert r["order"] == list(range(8)) and len(r["rows"]) < 8 // dp and max(r["rows"]) > 1, r
    assert all(t <= 160 for t in r["tokens"]), r
    assert r["diff"] < 1e-5, r


def test_batch_invariant_mode_holds_vllms_attention_to_one_tile_once(monkeypatch):
    """:func:`enable_batch_invariant_mode` (here with stand-ins for the vLLM modules it touches and a GPU faked)
    wraps the FLASH_ATTN backend's ``flash_attn_varlen_func`` with :func:`fixed_attention_tile` and the residual
    norm with :func:`residual_then_norm`, each once however often it runs."""
    import sys
    import types

    import megarl.kernels.batch_invariant as bi

    def module(name, **attrs):  # the module and its packages (a package already there is kept)
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        parent, _, child = name.rpartition(".")
        if parent not in sys.modules:
            module(parent, __path__=[])
        monkeypatch.setattr(sys.modules[parent], child, m, raising=False)
        return m

    layernorm = module("vllm.model_executor.layers.layernorm", rms_norm_batch_invariant=lambda x, w, eps: x)
    module("vllm.model_executor.layers.batch_invariant", init_batch_invariance=lambda: None)
    calls = []
    flash_attn = module("vllm.v1.attention.backends.flash_attn",
                        flash_attn_varlen_func=lambda *a, **kw: calls.append(kw["max_seqlen_q"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bi.os, "environ", {})
    monkeypatch.setattr(bi, "_ENABLED", False)
    assert bi.enable_batch_invariant_mode() and bi.enable_batch_invariant_mode() and bi.batch_invariant_mode()
    flash_attn.flash_attn_varlen_func(max_seqlen_q=1)
    assert calls == [bi.EXACT_MIN_QUERY_LEN] and flash_attn.flash_attn_varlen_func.fixes_the_tile
    assert layernorm.rms_norm_batch_invariant.adds_the_residual_first
    assert bi.os.environ == bi.BATCH_INVARIANT_ENV
