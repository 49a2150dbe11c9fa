"""GPU check of exact on-policy (``rollout.exact``, issue 46; marked ``gpu``, skipped without CUDA or vllm): with
vLLM in its batch-invariant mode and the trainer's old-log-prob pass on the same kernels, every sampled token's
old log-prob equals vLLM's rollout log-prob bit for bit (``mismatch/exact_tokens_frac`` 1.0), at step 1 and after
every reshard of the updated weights, for the tiny model of :mod:`tests.rl_tasks` and for SmolLM2-135M (real
weights: the default model). Each case is one ``megarl train`` of a few GRPO steps in a 1-rank world
(``perf/gpu_exact.sh`` runs it; the CPU half is tests/test_exact.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

STEPS = 4
GPU = ["rollout.engine=vllm", "model.dtype=bfloat16", "rollout.exact=true", "rollout.gpu_memory_utilization=0.3",
       f"trainer.steps={STEPS}", "trainer.save_every=0", "trainer.progress=false", "validation.enabled=false",
       "trainer.report=false"]


def _overrides(case: str, root) -> list[str]:
    if case == "tiny":  # peaked logits (embeddings x 3): bf16 near-ties would say nothing
        model = make_tiny_model(root / "model", embedding_scale=3.0)
        return [*task_overrides(model, write_prompts(root / "prompts.jsonl", 64), root / "runs", "tiny"),
                "data.prompts_per_step=8", "rollout.n=8", "actor.ppo_mini_batch_size=32", "actor.optim.lr=3e-3"]
    return [f"model.path={os.environ.get('SMOL_GGUF', 'default')}", f"run.output_dir={root / 'runs'}",
            "run.name=smollm2",  # the arithmetic task; SMOL_GGUF: the GGUF where build.sh did not install it
            "data.train_files=[" + str(root / "arithmetic" / "train.parquet") + "]", "actor.optim.lr=1e-5",
            "rollout.max_new_tokens=192"]  # sequences past 128 keys (FA3's prefill tile at head_dim 64)


@pytest.mark.parametrize("case", ["tiny", "smollm2"])
def test_trainer_logprobs_equal_vllms_bit_for_bit_at_every_step(tmp_path, case):
    history = run_world(train_on_rank, 1, [*_overrides(case, tmp_path), *GPU], timeout_s=900)[0]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    fracs = [h["mismatch/exact_tokens_frac"] for h in history]
    print(f"\nexact on GPU ({case}): exact_tokens_frac by step {fracs}, max |diff| "
          f"{[h['mismatch/abs_diff_max'] for h in history]}, token_mult_prob_error "
          f"{[h['mismatch/token_mult_prob_error'] for h in history]}")
    assert all(h["rollout/exact"] == 1.0 for h in history)
    assert fracs == [1.0] * STEPS, "the trainer's old log-probs differ from vLLM's (the warning names the first)"
    assert all(h["mismatch/abs_diff_max"] == 0.0 and h["mismatch/token_mult_prob_error"] == 1.0 for h in history)


# The probe below runs vLLM in-process beside the Megatron actor (as tests/test_gpu_vllm.py) on a 2-layer
# Qwen2 shape (random weights) and on SmolLM2-135M (real weights, 30 layers) and compares, tensor by tensor, what
# each computes for one prompt's prefill: when the trainer's log-probs are not vLLM's, the first differing tensor
# in forward order names the kernel that differs.
PROBE_SPEC = ModelSpec("qwen2", vocab_size=4000, hidden_size=512, num_layers=2, num_attention_heads=8,
                       num_kv_heads=2, head_dim=64, ffn_hidden_size=1408, rope_theta=1e6, tie_word_embeddings=True,
                       max_position_embeddings=1024, eos_token_ids=(3999,))


def probe_points(num_layers: int) -> list[tuple[str, str, str]]:
    """(vLLM module, Megatron module, which tensor: "in"/"q" the first input, "k" the second, "out" the output),
    in forward order."""
    return [("model.embed_tokens", "embedding", "out")] + [
        pair for i in range(num_layers) for pair in (
            (f"model.layers.{i}.input_layernorm", f"decoder.layers.{i}.input_layernorm", "out"),
            (f"model.layers.{i}.self_attn.qkv_proj", f"decoder.layers.{i}.self_attention.linear_qkv", "out"),
            (f"model.layers.{i}.self_attn.attn", f"decoder.layers.{i}.self_attention.core_attention", "q"),
            (f"model.layers.{i}.self_attn.attn", f"decoder.layers.{i}.self_attention.core_attention", "k"),
            (f"model.layers.{i}.self_attn.o_proj", f"decoder.layers.{i}.self_attention.linear_proj", "in"),
            (f"model.layers.{i}.self_attn.o_proj", f"decoder.layers.{i}.self_attention.linear_proj", "out"),
            (f"model.layers.{i}.post_attention_layernorm", f"decoder.layers.{i}.pre_mlp_layernorm", "out"),
            (f"model.layers.{i}.mlp.down_proj", f"decoder.layers.{i}.mlp.linear_fc2", "in"),
            (f"model.layers.{i}.mlp.down_proj", f"decoder.layers.{i}.mlp.linear_fc2", "out"))] + [
        ("model.norm", "decoder.final_layernorm", "out")]


def _capture(model, names: set[str], which: dict[str, set[str]], into: dict):
    """Forward hooks on ``model``'s modules ``names`` that keep, per module, the tensors of ``which[name]``
    (``in``/``q``: input 0, ``k``: input 1, ``out``: output 0) as ``[tokens, -1]`` float32."""
    def hook(name):
        def keep(module, args, kwargs, out):
            inputs = [*args, *kwargs.values()]  # megatron's embedding takes keywords only
            got = {"out": out[0] if isinstance(out, tuple) else out, "in": inputs[0] if inputs else None,
                   "q": inputs[0] if inputs else None, "k": inputs[1] if len(inputs) > 1 else None}
            for w in which[name]:
                if isinstance(t := got[w], torch.Tensor):
                    into[(name, w)] = t.detach().reshape(t.shape[0], -1).float().clone()  # [s, 1, ...]: b = 1
        return keep

    modules = dict(model.named_modules())  # a name the model lacks is reported as missing by the comparison
    return [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in names if n in modules]


def _probe(rank, world, case, eager=True):
    from megarl.kernels.batch_invariant import enable_batch_invariant_mode, vllm_kernels, vllm_logprobs
    from megarl.models.checkpoint import load_weights, source_spec
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings
    from tests.actor_decoding import actor_logits

    assert enable_batch_invariant_mode()
    mesh = ParallelLayout()
    initialize_model_parallel(mesh, seed=0)
    if case == "smollm2":
        path = os.environ.get("SMOL_GGUF", "default")
        spec = source_spec(path)[0]
        actor = build_model(spec, mesh, params_dtype=torch.bfloat16, attention="sdpa", init_weights=False)
        actor = actor.cuda().eval()
        load_weights(actor, path)
    else:
        spec = PROBE_SPEC
        actor = build_model(spec, mesh, params_dtype=torch.bfloat16, attention="sdpa").cuda().eval()
        with torch.no_grad():
            actor.embedding.word_embeddings.weight.mul_(3)
    engine = VLLMRolloutEngine(spec, tp=1, gpu_memory_utilization=0.3, seed=0, enforce_eager=eager,
                               settings=VLLMSettings(exact=True))
    plan = plan_reshard(megatron_layout(spec, mesh, padded_vocab=actor.vocab_size), engine.weight_layout([0]))
    src = {n: p.detach() for n, p in actor.named_parameters()}
    engine.update_weights(lambda dst: execute_plan(plan, src, dst))
    # 200 tokens: queries over one and over two of FA3's 128-key tiles (the probe was equal at 40 tokens, 2026-12-07,
    # and SmolLM2 on GSM8K, ~100-200-token prompts, was not: perf/RESULTS.md)
    prompt = torch.randint(0, spec.vocab_size - 1, (200,), generator=torch.Generator().manual_seed(0)).tolist()

    which_v, which_m = {}, {}
    points_wanted = probe_points(spec.num_layers) if eager else []  # compiled, vLLM's modules run no hooks
    for v, m, w in points_wanted:
        which_v.setdefault(v, set()).add(w)
        which_m.setdefault(m, set()).add(w)
    got_v, got_m = {}, {}
    handles = _capture(engine.model, set(which_v), which_v, got_v)
    engine.generate([prompt], SamplingConfig(temperature=1.0, max_new_tokens=1))  # the prompt's prefill only
    for h in handles:
        h.remove()
    handles = _capture(actor, set(which_m), which_m, got_m)
    with vllm_kernels([actor]):
        actor_logits(actor, prompt)
    for h in handles:
        h.remove()
    points = []
    for v, m, w in points_wanted:
        a, b = got_v.get((v, w)), got_m.get((m, w))
        if a is None or b is None or a.shape != b.shape:
            points.append((v, w, None, f"shapes {None if a is None else tuple(a.shape)} vs "
                                       f"{None if b is None else tuple(b.shape)}"))
            continue
        if w in ("q", "k") or v.endswith("qkv_proj"):  # megatron's per-group q/k/v order: compare sorted rows
            a, b = a.sort(dim=-1).values, b.sort(dim=-1).values
        points.append((v, w, int((a != b).sum()), f"max |diff| {(a - b).abs().max().item():.3g}"))

    # the sampled tokens' log-probs three ways: vLLM's decode (the rollout's), the trainer's exact pass, and
    # vLLM's own prefill of prompt + response (prompt_logprobs): where the trainer equals vLLM's prefill but not
    # its decode, decode attention over the paged KV cache is what differs. Eight prompts prefilled in one step
    # (980 tokens), each scored alone by the trainer: vLLM 0.24's fused add + RMSNorm changes its reduction at 256
    # tokens a step, which the exact mode must take out of the engine; and five of them long enough (150-200
    # tokens, 96 new ones) that queries see more than 128 and 192 keys, where FlashAttention 3's tile for a decode
    # step (192 keys wide at head_dim 64, both models here) parts from its prefill tile (128) unless the exact mode
    # holds it (kernels/batch_invariant.py, EXACT_MIN_QUERY_LEN)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(1)
    prompts = [prompt] + [torch.randint(0, spec.vocab_size - 1, (n,), generator=g).tolist()
                          for n in (40, 40, 40, 150, 150, 170, 190)]
    sampled = engine.generate(prompts, SamplingConfig(n=1, temperature=1.0, max_new_tokens=96, seed=7))
    # per comparison: tokens equal, max |diff|, and the same two over the tokens whose query sees > 128 keys
    counts = {name: [0, 0.0, 0, 0.0] for name in ("trainer_vs_decode", "trainer_vs_prefill", "prefill_vs_decode")}
    total = total_long = 0
    for s in sampled.samples:
        prompt = prompts[s.prompt_index]
        ids = prompt + list(s.token_ids)
        with vllm_kernels([actor]):
            logits = actor_logits(actor, ids)[None]
        labels = torch.tensor([ids[1:] + [0]], device=logits.device)
        lp = vllm_logprobs(logits, labels, vocab_size=spec.vocab_size, temperature=1.0)[0]
        mine = lp[len(prompt) - 1:len(ids) - 1].cpu()
        engine.llm.reset_prefix_cache()  # computed anew, not read from the decode's cache
        out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                  SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0), use_tqdm=False)
        prefill = torch.tensor([out[0].prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt), len(ids))])
        long = torch.arange(len(prompt), len(ids)) > 128  # the token at position j is read at a query over j keys
        total, total_long = total + len(mine), total_long + int(long.sum())
        for name, (a, b) in {"trainer_vs_decode": (mine, s.logprobs), "trainer_vs_prefill": (mine, prefill),
                             "prefill_vs_decode": (prefill, s.logprobs)}.items():
            c, diff = counts[name], (a - b).abs()
            c[0], c[1] = c[0] + int((diff == 0).sum()), max(c[1], diff.max().item())
            if long.any():
                c[2], c[3] = c[2] + int((diff[long] == 0).sum()), max(c[3], diff[long].max().item())
    return {"points": points, "total": total, "total_long": total_long, "counts": counts}


# smollm2-compiled: vLLM with torch.compile and CUDA graphs (the GPU main job's engine, where SmolLM2 on GSM8K was
# not exact, 2026-12-07; every earlier bit-for-bit check of SmolLM2 ran eager): the sampled tokens only
@pytest.mark.parametrize("case", ["qwen2-random", "smollm2", "smollm2-compiled"])
def test_the_exact_pass_equals_vllms_forward_tensor_by_tensor(case):
    r = run_world(_probe, 1, case.removesuffix("-compiled"), not case.endswith("-compiled"), timeout_s=600)[0]
    print(f"\nexact probe (vLLM prefill vs the trainer's exact pass, {case}, bf16):")
    shown = 0
    for name, which, ndiff, note in r["points"]:
        if ndiff == 0 or shown < 12:  # the equal ones and the first 12 that differ (the rest carry the difference)
            print(f"  {name} [{which}]: {'EQUAL' if ndiff == 0 else f'{ndiff} elements differ'} ({note})")
        shown += ndiff != 0
    for name, (equal, worst, equal_long, worst_long) in r["counts"].items():
        print(f"  sampled tokens' log-probs, {name}: {equal}/{r['total']} equal, max |diff| {worst:.3g}; over 128 "
              f"keys {equal_long}/{r['total_long']} equal, max |diff| {worst_long:.3g}")
    first = next((p for p in r["points"] if p[2] != 0), None)
    assert first is None, f"the first tensor that differs: {first}"
    assert r["total_long"] > 0 and all(c[0] == r["total"] for c in r["counts"].values())


def test_the_trainers_rope_frequencies_are_vllms_on_the_gpu():
    """The default RoPE's inverse frequencies megarl gives megatron on the GPU equal those vLLM 0.24's
    ``RotaryEmbedding._compute_inv_freq`` computes on the GPU (vLLM builds its model under the CUDA device), bit
    for bit (the exact pass's rotation starts from them; the probe's difference at the rotated q and k, with
    these fixed, was the rotation's rounding: ``vllm_rotary``)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from megarl.models.megatron import _set_rope_frequencies

    dim = PROBE_SPEC.head_dim
    with torch.device("cuda"):
        vllm_inv_freq = RotaryEmbedding._compute_inv_freq(SimpleNamespace(rotary_dim=dim), PROBE_SPEC.rope_theta)
    rotary = SimpleNamespace(inv_freq=torch.zeros(dim // 2, device="cuda"))
    _set_rope_frequencies(rotary, PROBE_SPEC)
    assert vllm_inv_freq.is_cuda and torch.equal(rotary.inv_freq, vllm_inv_freq)
