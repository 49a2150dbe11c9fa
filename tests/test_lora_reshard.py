"""The merged LoRA reshard (``actor.lora.sync=merged``): the reshard moves each engine rank's ``W`` block, the rows
of ``B`` and the columns of ``A`` it needs, and merges ``W + (alpha / r) B A`` in place; checked bit for bit against
an independent merge of the whole HF tensors followed by the slicing of ``tests/test_reshard_exact.py``, from
Megatron TP=2 (2 gloo ranks) into vLLM TP=2, vLLM TP=1 on each rank and whole HF tensors, in fp32 and in bf16.
The adapter-only layout (whole factors on every engine rank) is checked the same way. Phi-3's adapters are those
of its fused ``qkv_proj`` and ``gate_up_proj`` (one ``B`` each, cut by the reference's split of the fused rows).
"""

from __future__ import annotations

import torch

from tests.distributed import run_world
from tests.test_reshard_exact import MODELS, hf_weights, ref_megatron, ref_vllm

RANK, ALPHA = 3, 5.0
COLUMN = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}  # shared A of fused layers


def adapters(model: str, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random canonical adapters of every projection: ``B`` per projection, ``A`` shared by q/k/v and gate/up
    (Phi-3: the fused ``qkv_proj`` / ``gate_up_proj`` are the projections)."""
    w = hf_weights(model)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in w.items():
        if t.dim() != 2 or not any(f"{p}_proj" in name for p in ("q", "k", "v", "o", "gate", "up", "down")):
            continue
        proj = name.rsplit(".", 2)[-2].removesuffix("_proj")
        out[name.replace(".weight", ".lora_B.weight")] = torch.randn(t.shape[0], RANK, generator=g)
        a = name.replace(f"{proj}_proj.weight", f"{COLUMN.get(proj, proj)}_proj.lora_A.weight")
        if a not in out:
            out[a] = torch.randn(RANK, t.shape[1], generator=g)
    return out


def merged(w: dict, ad: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``W + (alpha / r) B A`` of every adapted HF weight (the product of the whole tensors in fp64, one rounding),
    the rest as is."""
    out = {}
    for name, t in w.items():
        b = ad.get(name.replace(".weight", ".lora_B.weight"))
        if b is None:
            out[name] = t.to(dtype)
            continue
        proj = name.rsplit(".", 2)[-2].removesuffix("_proj")
        a = ad[name.replace(f"{proj}_proj.weight", f"{COLUMN.get(proj, proj)}_proj.lora_A.weight")]
        out[name] = (t.to(dtype).double() + ALPHA / RANK * (b.to(dtype).double() @ a.to(dtype).double())).to(dtype)
    return out


def megatron_adapters(model: str, w: dict, ad: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Megatron's ``lora_a`` / ``lora_b`` of TP rank ``r`` (PP=1), cut by the reference slicer: a column-parallel
    layer's ``B`` as its weight's rows, a row-parallel layer's ``A`` as its weight's columns, the other whole."""
    as_b = {n.replace(".lora_B.weight", ".weight"): t for n, t in ad.items() if n.endswith("lora_B.weight")}
    as_a = {n.replace(".lora_A.weight", ".weight"): t for n, t in ad.items()
            if n.endswith(("o_proj.lora_A.weight", "down_proj.lora_A.weight"))}  # the row-parallel layers
    rows = ref_megatron(model, {**w, **as_b}, tp, 1, r, 0)  # weight-shaped tensors cut like the weights
    cols = ref_megatron(model, {**w, **as_a}, tp, 1, r, 0)
    out = {}
    layers = MODELS[model][3]
    for i in range(layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "self_attention.linear_qkv.lora_b"] = rows[m + "self_attention.linear_qkv.weight"]
        out[m + "self_attention.linear_qkv.lora_a"] = ad[p + "self_attn.qkv_proj.lora_A.weight"]
        out[m + "self_attention.linear_proj.lora_a"] = cols[m + "self_attention.linear_proj.weight"]
        out[m + "self_attention.linear_proj.lora_b"] = ad[p + "self_attn.o_proj.lora_B.weight"]
        out[m + "mlp.linear_fc1.lora_b"] = rows[m + "mlp.linear_fc1.weight"]
        out[m + "mlp.linear_fc1.lora_a"] = ad[p + "mlp.gate_up_proj.lora_A.weight"]
        out[m + "mlp.linear_fc2.lora_a"] = cols[m + "mlp.linear_fc2.weight"]
        out[m + "mlp.linear_fc2.lora_b"] = ad[p + "mlp.down_proj.lora_B.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _world(rank: int, world: int) -> dict:
    from megarl.models.layout import hf_layout
    from megarl.models.layout_lora import adapter_layout, with_lora_merge
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.lora import LoRASpec
    from megarl.models.spec import ModelSpec
    from megarl.parallel.mesh import ParallelLayout
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard

    lora = LoRASpec(RANK, ALPHA)
    results = {}
    for model in ("gqa_untied_bias", "gqa_tied", "phi3_gqa_untied"):
        fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
        spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
        w, ad = hf_weights(model), adapters(model)
        src = megatron_layout(spec, ParallelLayout(2, 1, 1), lora=lora)
        for dtype in (torch.float32, torch.bfloat16):
            src_tensors = {k: v.to(dtype) for k, v in {**ref_megatron(model, w, 2, 1, rank, 0),
                                                       **megatron_adapters(model, w, ad, 2, rank)}.items()}
            want_hf = merged(w, ad, dtype)
            for dst_name, dst, want in (
                    ("vllm2", vllm_layout(spec, 2, [0, 1]), ref_vllm(model, want_hf, 2, rank)),
                    ("vllm1", vllm_layout(spec, 1, [0, 1]), ref_vllm(model, want_hf, 1, 0)),
                    ("hf", hf_layout(spec, [0, 1]), want_hf)):
                plan = plan_reshard(src, with_lora_merge(dst, lora))
                got = {k: torch.zeros(lt.shape, dtype=dtype) for k, lt in dst.tensors(rank).items()}
                stats = execute_plan(plan, src_tensors, got, bucket_bytes=4096)
                bad = [k for k in want if not torch.equal(got[k], want[k].to(dtype))]
                results[f"{model} {dtype} -> {dst_name}"] = bad
                results[f"{model} {dtype} -> {dst_name} merge bytes"] = stats.merge_bytes
            whole = adapter_layout(spec, lora, [0, 1])
            got = {k: torch.zeros(lt.shape, dtype=dtype) for k, lt in whole.tensors(rank).items()}
            execute_plan(plan_reshard(src, whole), src_tensors, got)
            results[f"{model} {dtype} adapters"] = sorted(set(got) ^ set(ad)) + [
                k for k in ad if k in got and not torch.equal(got[k], ad[k].to(dtype))]
    return results


def test_merged_reshard_equals_merge_then_slice():
    for rank, res in enumerate(run_world(_world, 2, timeout_s=300)):
        for k, v in res.items():
            if k.endswith("merge bytes"):
                assert v > 0, (rank, k)
            else:
                assert v == [], (rank, k, v)


def test_config_and_memory_estimate_know_lora():
    """``actor.lora``'s target names are the model's; the memory estimate of a LoRA run counts the adapters'
    gradients and optimizer state only (hand-counted here) and no reference copy; ``parameter_counts`` counts
    the adapters once."""
    from megarl.config import LORA_TARGETS, load_config
    from megarl.launch.memory import estimate_memory
    from megarl.models.layout_lora import parameter_counts
    from megarl.models.lora import LoRASpec
    from megarl.models.spec import PRESETS

    assert LoRASpec(16, 32.0).target_modules == LORA_TARGETS  # every layer the config offers is adapted
    spec = PRESETS["qwen2.5-1.5b"]  # hidden 1536, q 1536, kv 256, ffn 8960, 28 layers
    r = 16
    layer = (r * 1536 + (1536 + 512) * r) + (r * 1536 + 1536 * r) + (r * 1536 + 2 * 8960 * r) + (r * 8960 + 1536 * r)
    assert parameter_counts(spec, LoRASpec(r, 32.0))["trainable"] == 28 * layer
    full = estimate_memory(load_config(None, ["model.dtype=bfloat16"]), spec, 1, gpu=False)
    lora = estimate_memory(load_config(None, ["model.dtype=bfloat16", f"actor.lora.rank={r}"]), spec, 1, gpu=False)
    assert lora.reference == 0 and full.reference == full.params
    assert lora.grads == 28 * layer * 4 and lora.optimizer == 28 * layer * 12
    assert lora.params == full.params + 28 * layer * 2
