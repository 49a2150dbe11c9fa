"""LoRA on the Megatron actor (``megarl.models.lora``) on 4 gloo ranks.

- Parity (fp64): with random nonzero ``A`` and ``B``, the LoRA model's logits equal those of a plain model whose
  weights are the merged ``W + (alpha / r) B A`` (1e-10 relative), and its adapters' gradients equal what the chain
  rule gives from the merged model's weight gradients (``dB = s G A^T``, ``dA = s B^T G``, summed over the TP ranks
  that hold the other factor's shards), at TP=2, TP=2 with sequence parallelism, PP=2 and TP=2 x PP=2. In fp64 the
  comparison is of the algebra and the communication: in fp32 the two models differ by the rounding of
  ``W + s B A`` and of the two matmul orders (measured here: 2e-6 relative in the logits, 2e-5 in the gradients).
- With ``B = 0`` the LoRA model's logits are the base model's bit for bit, and so are they with nonzero adapters
  switched off (the reference policy).
- One PPO update of a LoRA ``PolicyWorker`` (TP=2 x DP=2, distributed optimizer) changes the adapters only (the base
  bit-identical), its optimizer holds only adapter tensors, and the reference log-probs (adapters off) still equal
  a plain base model's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

SPEC = ModelSpec("qwen2", vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                 head_dim=8, ffn_hidden_size=48, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 max_position_embeddings=64)
MESHES = [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, False)]  # (tp, pp, sequence parallel) in a world of 4
RANK, ALPHA = 4, 8.0
DTYPE = torch.float64
TOLERANCE = 1e-10


def _canonical(seed: int, lora):
    """Random base weights, random nonzero adapters, and the merged weights ``W + s B A`` (fp64)."""
    from megarl.models.layout_lora import lora_canonical_shapes, lora_targets

    g = torch.Generator().manual_seed(seed)
    w = {n: ((1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else 0.2 * torch.randn(s, generator=g)).to(DTYPE)
         for n, s in SPEC.hf_tensor_shapes().items()}
    ad = {n: 0.3 * torch.randn(s, generator=g).to(DTYPE) for n, s in lora_canonical_shapes(SPEC, lora).items()}
    merged = dict(w)
    for name, (a, b) in lora_targets(SPEC, lora).items():
        merged[name] = w[name] + lora.scale * ad[b] @ ad[a]
    return w, ad, merged


def _build(mesh, sp: bool, tensors: dict, lora=None):
    from megatron.core import parallel_state as ps

    from megarl.models.layout_lora import lora_canonical_shapes
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader

    model = build_model(SPEC, mesh, sequence_parallel=sp, init_weights=False, lora=lora, params_dtype=DTYPE)
    local = megatron_rank_tensors(SPEC, mesh, ps.get_tensor_model_parallel_rank(),
                                  ps.get_pipeline_model_parallel_rank(), padded_vocab=model.vocab_size, lora=lora)
    shapes = {**SPEC.hf_tensor_shapes(), **(lora_canonical_shapes(SPEC, lora) if lora else {})}
    fill_local_tensors(local, dict(model.named_parameters()), state_dict_reader(tensors, shapes))
    if lora is None:
        model.requires_grad_(True)
    return model


def _forward_backward(model, tokens, weights, backward: bool = True):
    """Full-vocab logits ``[b, s, vocab]`` on the last stage (None elsewhere) of ``sum(logits * weights)``'s
    forward, and its backward into the parameters' ``.grad``."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.models.pipeline import run_microbatches

    def output_fn(mb, out):
        full = gather_from_tensor_model_parallel_region(out)[..., :SPEC.vocab_size]
        return (full * weights).sum(), {"logits": full.detach().clone()}

    for p in model.parameters():
        p.grad = None
    if backward:
        model.train()
        res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=False)
    else:
        model.eval()
        with torch.no_grad():
            res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=True)
    return res[0]["logits"] if res else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _world(rank, world, model_dir):
    return {"parity": _parity(rank, world), "update": _update(rank, world, model_dir)}


def _parity(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models.lora import LoRASpec, adapters_disabled, lora_modules, reduce_partial_grads
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    lora = LoRASpec(RANK, ALPHA)
    w, ad, merged = _canonical(1, lora)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 16), generator=g)
    weights = torch.randn(2, 16, SPEC.vocab_size, generator=g).to(DTYPE)
    out = {}
    for tp, pp, sp in MESHES:
        label = f"tp{tp} pp{pp}{' sp' if sp else ''}"
        mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp))
        initialize_model_parallel(mesh)
        tp_group = ps.get_tensor_model_parallel_group()
        plain = _build(mesh, sp, merged)
        want = _forward_backward(plain, tokens, weights)
        model = _build(mesh, sp, {**w, **ad}, lora)
        got = _forward_backward(model, tokens, weights)
        reduce_partial_grads(model, tp_group)
        res = {"logits": _rel(got, want) if got is not None else 0.0}
        plain_params = dict(plain.named_parameters())
        worst = 0.0
        for name, m in model.named_modules():
            if m not in set(lora_modules(model)):
                continue
            gw = plain_params[name + ".weight"].grad.double()
            a, b = m.lora_a.detach().double(), m.lora_b.detach().double()
            want_b, want_a = lora.scale * gw @ a.T, lora.scale * b.T @ gw
            for whole in ([want_a] if m.lora_b.tensor_model_parallel else
                          [want_b] if m.lora_a.tensor_model_parallel else []):
                dist.all_reduce(whole, group=tp_group)
            worst = max(worst, _rel(m.lora_a.grad.double(), want_a), _rel(m.lora_b.grad.double(), want_b))
        res["grads"] = worst
        # B = 0: the base, bit for bit; nonzero adapters switched off: the base too
        base = _build(mesh, sp, w)
        base_logits = _forward_backward(base, tokens, weights, backward=False)
        with adapters_disabled(model):
            off = _forward_backward(model, tokens, weights, backward=False)
        for m in lora_modules(model):
            m.lora_b.data.zero_()
        zero_b = _forward_backward(model, tokens, weights, backward=False)
        if base_logits is not None:
            res["disabled_equal"] = torch.equal(off, base_logits)
            res["zero_b_equal"] = torch.equal(zero_b, base_logits)
        out[label] = res
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    from tests.rl_tasks import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", layers=2)
    return run_world(_world, 4, str(model_dir), timeout_s=900)


@pytest.fixture(scope="module")
def parity(results) -> list[dict]:
    return [r["parity"] for r in results]


def test_lora_logits_and_gradients_equal_the_merged_model(parity):
    labels = {k for res in parity for k in res}
    assert labels == {"tp2 pp1", "tp2 pp1 sp", "tp1 pp2", "tp2 pp2"}
    for rank, res in enumerate(parity):
        for label, r in res.items():
            assert r["logits"] < TOLERANCE, (rank, label, r)
            assert r["grads"] < TOLERANCE, (rank, label, r)


def test_zero_b_and_disabled_adapters_are_the_base_bit_for_bit(parity):
    checked = 0
    for rank, res in enumerate(parity):
        for label, r in res.items():
            if "zero_b_equal" in r:
                assert r["zero_b_equal"] and r["disabled_equal"], (rank, label, r)
                checked += 1
    assert checked >= 8  # the last stage of every mesh on every DP/TP rank


def _update(rank, world, model_dir):
    from megatron.core import parallel_state as ps

    from megarl.config import load_config
    from megarl.models.checkpoint import as_chunks
    from megarl.models.lora import is_adapter
    from megarl.models.spec import ModelSpec as MS
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.data.batch import build_batch
    from megarl.workers.actor import BasePolicy, PolicyWorker

    cfg = load_config(None, ["actor.lora.rank=4", "actor.lora.alpha=16", "actor.parallel.tp=2", "actor.micro_batch_size=2",
                             "actor.ppo_mini_batch_size=8", "actor.optim.lr=1e-2"])
    spec: MS = open_hf_checkpoint(model_dir).spec
    mesh = ParallelLayout(tp=2, pp=1, dp=2)
    initialize_model_parallel(mesh)
    actor = PolicyWorker(spec, mesh, "actor", model_dir, torch.float32, cfg.actor, trainable=True, total_updates=4,
                         temperature=1.0, seed=3)
    base = PolicyWorker(spec, mesh, "actor", model_dir, torch.float32, load_config(None, []).actor,
                        trainable=False, temperature=1.0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 14, (4,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(3, 16, (3,), generator=g).tolist() for _ in range(8)]
    batch = build_batch(prompts, responses, [torch.zeros(3) for _ in range(8)], list(range(8)), pad_token_id=0,
                        seq_multiple=16)
    before = {n: p.detach().clone() for n, p in as_chunks(actor.model)[0].named_parameters()}
    ref_before = BasePolicy(actor).compute_logprobs(batch)["logprobs"]
    plain = base.compute_logprobs(batch)["logprobs"]
    batch["old_logprobs"] = actor.compute_logprobs(batch)["logprobs"]
    batch["ref_logprobs"] = ref_before
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    for _ in range(2):
        actor.update(batch, cfg.algorithm, seed=1)
    after = dict(as_chunks(actor.model)[0].named_parameters())
    changed = sorted(n for n, p in after.items() if not torch.equal(p.detach(), before[n]))
    opts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    in_optimizer = [p for opt in opts for group in opt.optimizer.param_groups for p in group["params"]]
    model_params = {p for opt in opts for p in opt.model_param_group_index_map}
    names = {id(p): n for n, p in after.items()}
    return {"changed": changed, "adapters": sorted(n for n in after if is_adapter(n)),
            "optimizer_params": sorted(names[id(p)] for p in model_params),
            "optimizer_elements": sum(p.numel() for p in in_optimizer),
            "adapter_elements": sum(p.numel() for n, p in after.items() if is_adapter(n)) // ps.get_data_parallel_world_size(),
            "ref_equal_before": torch.equal(ref_before, plain),
            "ref_equal_after": torch.equal(BasePolicy(actor).compute_logprobs(batch)["logprobs"], plain),
            "actor_moved": not torch.equal(actor.compute_logprobs(batch)["logprobs"], plain),
            "grad_buffer_params": sorted(names[id(p)] for b in actor.model.buffers + actor.model.expert_parallel_buffers
                                         for p in b.params)}


def test_an_update_changes_only_the_adapters(results):
    results = [r["update"] for r in results]
    # the distributed optimizer covers the adapters only, each DP rank its share of them
    assert set().union(*(r["optimizer_params"] for r in results)) == set(results[0]["adapters"])
    for rank, r in enumerate(results):
        assert r["changed"] == r["adapters"] and r["adapters"], (rank, r["changed"])
        assert set(r["optimizer_params"]) <= set(r["adapters"]), rank
        assert r["grad_buffer_params"] == r["adapters"], rank  # DDP keeps gradient buffers of the adapters only
        # its fp32 shards: this DP rank's share of the adapters (the base has none)
        assert abs(r["optimizer_elements"] - r["adapter_elements"]) <= 2 * len(r["adapters"]), (rank, r)
        assert r["ref_equal_before"] and r["ref_equal_after"] and r["actor_moved"], (rank, r)


def test_a_peft_export_names_its_real_base_and_the_peft_its_expert_adapters_need(tmp_path, caplog, monkeypatch):
    """Issue 48: the exported adapter named its base "default" (the CPU default), which peft's
    ``AutoPeftModelForCausalLM`` took for a hub name and fetched (offline: failed); it names the base's absolute
    path now, a relative one resolved. Adapters on the MoE experts need peft >= 0.20 (older ones ignore them
    without a word): the folder's metadata says so, and the export warns."""
    import json
    import logging

    from safetensors import safe_open

    from megarl.models.convert import adapter_base
    from megarl.models.hf_io import default_model_path
    from megarl.models.layout_lora import lora_targets
    from megarl.models.lora import LoRASpec
    from megarl.models.peft import MIN_PEFT_EXPERTS, save_peft_adapter
    from megarl.models.spec import preset

    assert MIN_PEFT_EXPERTS == "0.20.0"
    assert adapter_base(None) == str(default_model_path()) and adapter_base("default") == adapter_base(None)
    (tmp_path / "base").mkdir()
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        assert adapter_base("base") == str(tmp_path / "base")
    spec = preset("tiny-qwen3-moe")
    shapes = spec.hf_tensor_shapes()
    for experts in (False, True):
        lora = LoRASpec(rank=2, alpha=4.0, experts=experts)
        adapters = {}
        for w, (a, b) in lora_targets(spec, lora).items():
            out_rows, in_cols = shapes[w]
            adapters.setdefault(a, torch.zeros(2, in_cols))
            adapters.setdefault(b, torch.zeros(out_rows, 2))
        folder = tmp_path / f"adapter_{experts}"
        with caplog.at_level(logging.WARNING, logger="megarl.models.peft"):
            caplog.clear()
            save_peft_adapter(folder, spec, lora, adapters, str(tmp_path / "base"))
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tmp_path / "base")
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            assert f.metadata().get("min_peft_version") == ("0.20.0" if experts else None)
            assert any(".experts." in k for k in f.keys()) == experts
        assert any("peft >= 0.20.0" in r.message for r in caplog.records) == experts


def test_phi3_adapters_are_peft_s_own_on_its_fused_projections():
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` are adapted as whole modules: megarl's PEFT export has the
    names and shapes that peft itself gives transformers' Phi-3 for the same target modules, and Megatron's TP=2
    ``linear_qkv`` holds each rank's rows of the one ``qkv_proj.lora_B`` (both ranks the whole ``lora_A``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megarl.models.layout_lora import lora_canonical_shapes
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.lora import LoRASpec
    from megarl.models.peft import peft_tensors, target_modules
    from megarl.parallel.mesh import ParallelLayout

    spec = ModelSpec("phi3", 97, 32, 2, 4, 2, 8, 48, max_position_embeddings=64)
    lora = LoRASpec(rank=4, alpha=8.0)
    assert target_modules(spec, lora) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    ours = {n: tuple(t.shape) for n, t in peft_tensors(spec, lora, {n: torch.zeros(s) for n, s in
                                                                   lora_canonical_shapes(spec, lora).items()}).items()}
    model = get_peft_model(AutoModelForCausalLM.from_config(spec.to_hf_config()),
                           LoraConfig(r=4, lora_alpha=8, target_modules=target_modules(spec, lora)))
    theirs = {n.replace(".default.", "."): tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}
    assert ours == theirs
    layout = megatron_layout(spec, ParallelLayout(tp=2, pp=1, dp=1), lora=lora)
    for r in (0, 1):
        b = layout.tensors(r)["decoder.layers.0.self_attention.linear_qkv.lora_b"]
        assert {blk.name for blk in b.blocks} == {"model.layers.0.self_attn.qkv_proj.lora_B.weight"}
        assert b.shape == ((4 + 2 * 2) * 8 // 2, 4)
        a = layout.tensors(r)["decoder.layers.0.self_attention.linear_qkv.lora_a"]
        assert a.shape == (4, 32) and a.blocks[0].size == (4, 32)
