"""GPU checks of ``kernels/`` (marked ``gpu``; skipped without CUDA), bf16 on one GPU:

- the Triton softmax-statistics and logits-gradient kernels equal the same math in fp32 torch ops on the same
  bf16 logits (they read bf16 and compute in fp32: only summation order differs);
- a Qwen2-shaped actor with both switches on (Triton chunked log-probs, SDPA attention) against the plain
  model on the same weights: the differences are bf16 rounding of the logits and attention (printed; bounded
  loosely), and the chunked path's Triton and torch backends agree closely.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = ModelSpec("qwen2", vocab_size=32000, hidden_size=512, num_layers=4, num_attention_heads=8, num_kv_heads=2,
                 head_dim=64, ffn_hidden_size=1408, rope_theta=1e6, tie_word_embeddings=True,
                 max_position_embeddings=1024)


def test_triton_kernels_equal_torch_ops_on_bf16_logits():
    from megarl.kernels.triton_logprobs import logits_grad_, softmax_stats

    g = torch.Generator(device="cuda").manual_seed(0)
    n, v, temp = 300, 20000, 0.7
    logits = (torch.randn(n, v, device="cuda", generator=g) * 4).to(torch.bfloat16)
    m, s, t = softmax_stats(logits, temp)
    z = logits.float() / temp
    m_ref = z.max(-1).values
    e = (z - m_ref[:, None]).exp()
    assert torch.equal(m, m_ref)
    torch.testing.assert_close(s, e.sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(t, (e * (z - m_ref[:, None])).sum(-1), rtol=1e-4, atol=1e-4)

    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    log_sum = s.log()
    stats = torch.stack([m, log_sum, t / s])
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    p = (z - m[:, None] - log_sum[:, None]).exp()
    want = -g_lp[:, None] * p + g_ent[:, None] * p * ((t / s)[:, None] - (z - m[:, None]))
    want[torch.arange(n), labels] += g_lp
    want = want / temp
    got = logits_grad_(logits.clone(), labels, stats, g_lp, g_ent, temp)
    assert (got.float() - want).abs().max() <= 2 * want.abs().max() * 2**-8  # bf16 rounding of the output


def _model(rank, world):
    from megarl.kernels.chunked_logprobs import LogprobOutput
    from megarl.models.logprobs import vocab_parallel_logprobs
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    torch.manual_seed(0)
    plain = build_model(SPEC, mesh, params_dtype=torch.bfloat16, attention="local").cuda()
    fast = build_model(SPEC, mesh, params_dtype=torch.bfloat16, attention="sdpa").cuda()
    fast.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, SPEC.vocab_size, (4, 512), device="cuda")

    def run(model, backend):
        kwargs = None if backend is None else {"output_processor": LogprobOutput(
            vocab_size=SPEC.vocab_size, with_entropy=True, chunk_tokens=700, backend=backend)}

        def output_fn(mb, out):
            if backend is None:
                out = vocab_parallel_logprobs(out, torch.roll(tokens, -1, 1), vocab_size=SPEC.vocab_size,
                                              with_entropy=True)
            lp, ent = out
            return -lp.mean() - 0.01 * ent.mean(), {"lp": lp.detach(), "ent": ent.detach()}

        for p in model.parameters():
            p.grad = None
        res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=False, model_kwargs=kwargs)
        return res[0], {n: p.grad.float().clone() for n, p in model.named_parameters()}

    ref, g_ref = run(plain, None)
    tri, g_tri = run(fast, "triton")
    tor, _ = run(fast, "torch")
    rel = max(float((g_ref[n] - g_tri[n]).abs().max() / g_ref[n].abs().max()) for n in g_ref)
    return {"lp": float((ref["lp"] - tri["lp"]).abs().max()), "ent": float((ref["ent"] - tri["ent"]).abs().max()),
            "lp_mean": float((ref["lp"] - tri["lp"]).abs().mean()), "grad_rel": rel,
            "triton_vs_torch_lp": float((tri["lp"] - tor["lp"]).abs().max()),
            "triton_vs_torch_ent": float((tri["ent"] - tor["ent"]).abs().max())}


def test_bf16_actor_with_kernels_close_to_plain_actor():
    r = run_world(_model, 1)[0]
    print(f"\nbf16, both kernels vs plain: {r}")
    assert r["lp"] <= 0.25 and r["lp_mean"] <= 0.02 and r["ent"] <= 0.25, r
    assert r["grad_rel"] <= 0.1, r
    assert r["triton_vs_torch_lp"] <= 1e-4 and r["triton_vs_torch_ent"] <= 1e-4, r
