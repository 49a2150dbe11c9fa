"""megarl's torch gated delta rule and causal convolution (``kernels/gated_delta_rule.py``, the kernels megatron-core's
``GatedDeltaNet`` runs on where ``fla`` is absent) against transformers' Qwen3.5 references, fp32 on CPU: outputs,
final states and gradients; packed documents (``cu_seqlens``) against each document run alone."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

from megarl.kernels import gated_delta_rule as gdr


def _inputs(b=2, t=37, hk=2, hv=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(b, t, hv, generator=gen))  # log decay <= 0
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_chunked_and_recurrent_match_transformers(chunk_size):
    q, k, v, g, beta, state = _inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    out, final = gdr.chunk_gated_delta_rule(*leaves, initial_state=state, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    grads = torch.autograd.grad((out * torch.cos(out)).sum() + final.square().sum(), leaves)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    rq, rk = (x.repeat_interleave(2, dim=2) for x in ref_leaves[:2])  # transformers repeats the key heads first
    for fn, kw in ((ref.torch_chunk_gated_delta_rule, dict(chunk_size=chunk_size)),
                   (ref.torch_recurrent_gated_delta_rule, {})):
        r_out, r_final = fn(rq, rk, *ref_leaves[2:], initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, **kw)
        torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, r_final, atol=1e-5, rtol=1e-5)
        r_grads = torch.autograd.grad((r_out * torch.cos(r_out)).sum() + r_final.square().sum(), ref_leaves)
        for mine, theirs in zip(grads, r_grads):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    rec, rec_final = gdr.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, rec_final, atol=1e-5, rtol=1e-5)


def test_packed_documents_do_not_share_state():
    q, k, v, g, beta, _ = _inputs(b=1, t=30)
    cu = torch.tensor([0, 7, 7, 20, 30])
    out, final = gdr.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            cu_seqlens=cu, chunk_size=4)
    weight, bias = torch.randn(24, 4), torch.randn(24)
    x = torch.randn(1, 30, 24)
    conv, _ = gdr.causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu)
    for i, (s, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        if s == e:
            continue
        alone, alone_final = ref.torch_chunk_gated_delta_rule(
            *(x_[:, s:e].repeat_interleave(2, dim=2) for x_ in (q, k)), v[:, s:e], g[:, s:e], beta[:, s:e],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, s:e], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i:i + 1], alone_final, atol=1e-5, rtol=1e-5)
        conv_alone = ref.causal_conv1d_fn(x[:, s:e].transpose(1, 2), weight, bias, activation="silu")
        torch.testing.assert_close(conv[:, s:e], conv_alone.transpose(1, 2), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 29]))
