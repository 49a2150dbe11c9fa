"""GPU checks of block-FP8 rollouts (marked ``gpu``; skipped without CUDA or vllm 0.24.0).

1. The reshard's quantise kernel (``megarl._C.quantize_fp8_blocks`` on CUDA) equals vLLM 0.24.0's own block
   quantisation, ``vllm.utils.deep_gemm.per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)``, bit for bit
   (E4M3 bytes and float32 scales) on bf16 weights of the Qwen2.5-1.5B shapes (with partial edge tiles, an
   all-zero tile and outliers), run eagerly. The function as vLLM ships it is torch.compile'd, and Inductor lowers
   its float32 divisions to Triton's approximate ``div.full.f32`` (torch 2.11,
   ``eager_numerics.division_rounding`` off by default): its mismatches are printed, not asserted.
2. A block-FP8 vLLM engine written by the reshard from a Megatron actor (one process, one GPU): its E4M3 weights
   and scales equal quantising the actor's tensors on the CPU (:func:`megarl.models.fp8.quantize_blocks`); it
   decodes close to the bf16 actor (vLLM also quantises activations per 128-element group, so agreement is close,
   not exact: the sampled-token log-probs against the actor's teacher-forced ones, and the greedy tokens, are
   printed and bounded); weights written again in place take effect; sleep level 1 keeps them. Writes that
   missed vLLM's tensors after ``process_weights_after_loading`` (another layout, stale scales) decode noise.
   Peaked logits (embeddings x 3), as tests/test_gpu_vllm.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.actor_decoding import actor_greedy, actor_teacher_forced
from tests.distributed import run_world

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (300, 200)]  # qkv, o, gate_up, down; edges
SPEC = ModelSpec("qwen2", vocab_size=4000, hidden_size=512, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                 head_dim=128, ffn_hidden_size=1536, rope_theta=1e6, tie_word_embeddings=True,
                 max_position_embeddings=1024, eos_token_ids=(3999,))  # every split a whole 128-block
PROMPT_LENGTHS = (5, 17, 33, 64)
GREEDY_TOKENS = 32


def _weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[torch.rand(shape, generator=g) < 1e-4] *= 300  # outliers: a few tiles with a far larger amax
    w[:128, :128] = 0  # an all-zero tile: the 1e-4 floor of the amax
    return w.to(torch.bfloat16).cuda()


def test_the_quantise_kernel_equals_vllms_block_quantisation_bit_for_bit():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from megarl.reshard import boxcopy
    from megarl.reshard.quantize import quantize_tensor

    assert boxcopy.extension_available(), "megarl._C is not built (perf/build_C.sh)"
    compiled_mismatch = []
    for k, shape in enumerate(SHAPES):
        w = _weight(shape, k)
        q, s = quantize_tensor(w, use_extension=True)
        with torch.compiler.set_stance("force_eager"):
            q_ref, s_ref = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)
        assert q.dtype == q_ref.dtype == torch.float8_e4m3fn and s_ref.dtype == torch.float32
        assert torch.equal(s, s_ref), (shape, (s != s_ref).sum().item())
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), \
            (shape, (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item())
        q_c, s_c = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)
        compiled_mismatch.append((shape, int((s_c != s).sum()), int((q_c.view(torch.uint8) != q.view(torch.uint8)).sum())))
    print("\nFP8 quantise kernel = vLLM per_block_cast_to_fp8 (eager) bit for bit on", SHAPES,
          "; vLLM's compiled form differs in (scales, bytes):", compiled_mismatch)


def _fp8_engine(rank, world):
    from megarl.models import fp8
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings

    mesh = ParallelLayout()
    initialize_model_parallel(mesh, seed=0)
    actor = build_model(SPEC, mesh, params_dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        actor.embedding.word_embeddings.weight.mul_(3)  # peaked logits (tied: the output layer too)
    engine = VLLMRolloutEngine(SPEC, tp=1, gpu_memory_utilization=0.3, seed=0, enforce_eager=True,
                               settings=VLLMSettings(quantization="fp8"))
    src_layout = megatron_layout(SPEC, mesh, padded_vocab=actor.vocab_size)
    dst_layout = engine.weight_layout([0])
    plan = plan_reshard(src_layout, dst_layout)
    src = {n: p.detach() for n, p in actor.named_parameters()}

    def reshard():
        return engine.update_weights(lambda dst: execute_plan(plan, src, dst))

    stats = reshard()
    r = {"tiles": stats.tiles_quantized, "dtypes": sorted({str(p.dtype) for p in engine._params.values()})}
    # (a) the engine's E4M3 bytes and scales: the actor's tensors quantised on the CPU
    canonical = {}
    for lt in src_layout.tensors(0).values():
        for b in lt.blocks:
            canonical.setdefault(b.name, torch.zeros(src_layout.canonical[b.name]))[b.src_box] = \
                src[lt.name][b.dst_box].float().cpu()
    plain = vllm_layout(SPEC, 1, [0])  # the same tensors unquantised
    want = {n: torch.zeros(lt.shape) for n, lt in plain.tensors(0).items()}
    fill_local_tensors(plain.tensors(0), want, state_dict_reader(canonical, plain.canonical))
    wrong = []
    for name, lt in dst_layout.tensors(0).items():
        if lt.scale:
            q, s = fp8.quantize_blocks(want[name].to(torch.bfloat16))
            got = engine._params[name].view(torch.uint8).cpu()
            if not (torch.equal(got, q.view(torch.uint8)) and torch.equal(engine._params[lt.scale].cpu(), s)):
                wrong.append(name)
    r["wrong"] = wrong

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SPEC.vocab_size - 1, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=GREEDY_TOKENS)

    def decode():
        return [list(s.token_ids) for s in engine.generate(prompts, greedy).samples]

    # (b) close to the bf16 actor: greedy tokens and sampled-token log-probs
    r["vllm_greedy"] = decode()
    r["actor_greedy"] = [actor_greedy(actor, SPEC, p, GREEDY_TOKENS) for p in prompts]
    sampled = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=48, seed=7))
    diffs = torch.cat([(actor_teacher_forced(actor, SPEC, prompts[s.prompt_index], s.token_ids) - s.logprobs).abs()
                       for s in sampled.samples])
    r.update(logprob_mean_diff=diffs.mean().item(), logprob_max_diff=diffs.max().item())
    # (c) new weights written in place take effect, the first ones back restore the output
    saved = {n: p.detach().clone() for n, p in actor.named_parameters()}
    with torch.no_grad():
        actor.decoder.final_layernorm.weight.neg_()
        for n, p in actor.named_parameters():
            if "linear_fc2" in n:
                p.mul_(-1.5)  # a quantised weight (new scales), not only the bf16 norm
    reshard()
    r["other_greedy"] = decode()
    with torch.no_grad():
        for n, p in actor.named_parameters():
            p.copy_(saved[n])
    reshard()
    r["restored_greedy"] = decode()
    # (d) sleep level 1 keeps the E4M3 weights and their scales
    engine.sleep(1)
    engine.wake_up()
    r["after_sleep1"] = decode()
    return r


@pytest.fixture(scope="module")
def fp8_engine():
    return run_world(_fp8_engine, 1, timeout_s=600)[0]


def test_the_fp8_engine_holds_the_quantised_actor_and_decodes_like_it(fp8_engine):
    r = fp8_engine
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"], r["dtypes"]
    assert r["tiles"] > 0 and not r["wrong"], r["wrong"]
    agree = [sum(a == b for a, b in zip(x, y)) / len(y) for x, y in zip(r["vllm_greedy"], r["actor_greedy"])]
    print(f"\nFP8 vLLM engine vs the bf16 actor: greedy tokens agree {agree}, |log-prob diff| mean "
          f"{r['logprob_mean_diff']:.4f}, max {r['logprob_max_diff']:.3f}")
    # FP8 weights and activations are close to bf16, not equal: bounds that wrong or stale weights (noise, ~17
    # nats on the fake engine of tests/test_rollout_vllm_tp.py's shapes) cannot meet
    assert r["logprob_mean_diff"] < 1.0, r["logprob_mean_diff"]
    assert sum(a[0] == b[0] for a, b in zip(r["vllm_greedy"], r["actor_greedy"])) >= 3  # first tokens, of 4 prompts


def test_fp8_weights_written_again_take_effect_and_survive_sleep(fp8_engine):
    r = fp8_engine
    assert r["other_greedy"] != r["vllm_greedy"]
    assert r["restored_greedy"] == r["vllm_greedy"]
    assert r["after_sleep1"] == r["vllm_greedy"]
