"""GPU checks of the Megatron builders (marked ``gpu``; skipped without CUDA): a Qwen2-shaped actor, and a
Mistral-shaped one with a 64-token sliding window over 256-token sequences, in bf16 on the GPU match
transformers' bf16 logits on the same weights, and their backward gives finite gradients."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = ModelSpec("qwen2", vocab_size=4096, hidden_size=512, num_layers=4, num_attention_heads=8, num_kv_heads=2,
                 head_dim=64, ffn_hidden_size=1408, rope_theta=1e6, tie_word_embeddings=True,
                 max_position_embeddings=1024)
MISTRAL = ModelSpec("mistral", vocab_size=4096, hidden_size=512, num_layers=4, num_attention_heads=8, num_kv_heads=2,
                    head_dim=64, ffn_hidden_size=1408, max_position_embeddings=1024, sliding_window=64)


def _check(rank, world, spec):
    from transformers import AutoModelForCausalLM

    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.bfloat16).cuda().eval()
    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    model = build_model(spec, mesh, params_dtype=torch.bfloat16, init_weights=False).cuda()
    fill_local_tensors(megatron_rank_tensors(spec, mesh, 0, 0), dict(model.named_parameters()),
                       state_dict_reader(ref.state_dict(), spec.hf_tensor_shapes()))
    tokens = torch.randint(0, spec.vocab_size, (4, 256), device="cuda")
    with torch.no_grad():
        want = ref(tokens).logits.float()
    window_gap = None
    if spec.sliding_window:  # the same weights with full attention: how far a model that ignored the window is
        full = AutoModelForCausalLM.from_config(spec.replace(sliding_window=None).to_hf_config(),
                                                dtype=torch.bfloat16).cuda().eval()
        full.load_state_dict(ref.state_dict())
        with torch.no_grad():
            window_gap = (full(tokens).logits.float() - want).abs().max().item()

    def loss_fn(mb, logits):
        loss = logits.float().logsumexp(-1).mean()
        return loss, {"logits": logits.detach().float()}

    out = run_microbatches(model, [{"input_ids": tokens}], loss_fn, forward_only=False)
    got = out[0]["logits"][..., :spec.vocab_size]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "grads": len(grads), "finite": all(torch.isfinite(g).all().item() for g in grads),
            "window_gap": window_gap}


@pytest.mark.parametrize("spec", [SPEC, MISTRAL], ids=["qwen2", "mistral-sliding-window"])
def test_bf16_actor_matches_transformers_and_backpropagates_on_gpu(spec):
    r = run_world(_check, 1, spec)[0]
    assert r["max_diff"] <= 0.05 * max(1.0, r["scale"]), r  # bf16: two kernels' rounding, not a layout error
    assert r["grads"] > 0 and r["finite"], r
    if spec.sliding_window:
        assert r["max_diff"] < 0.5 * r["window_gap"], r  # the window, not only bf16 rounding, is compared
