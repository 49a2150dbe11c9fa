"""vocab_parallel_logprobs on an explicit process group (no megatron parallel state): TP rank and size come from
the group, and the result equals the log-softmax and entropy of the full vocab."""

from __future__ import annotations

import torch

from tests.distributed import run_world

VOCAB, PADDED = 45, 48  # three padding columns on the last rank


def _on_group(rank, world):
    import torch.distributed as dist

    from megarl.models.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, PADDED, generator=g)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    group = dist.new_group(list(range(world)))
    part = PADDED // world
    local = logits[..., rank * part:(rank + 1) * part].clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(local, labels, vocab_size=VOCAB, temperature=0.7, with_entropy=True,
                                        tp_group=group)
    logp.sum().backward()
    return logp.detach(), ent.detach(), local.grad


def test_tp_rank_and_size_are_read_from_the_group():
    g = torch.Generator().manual_seed(0)
    full, labels = torch.randn(2, 5, PADDED, generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)
    z = (full[..., :VOCAB] / 0.7).requires_grad_()
    ref = z.log_softmax(-1)
    want_logp = ref.gather(-1, labels[..., None]).squeeze(-1)
    want_ent = -(ref.exp() * ref).sum(-1)
    (grad,) = torch.autograd.grad(want_logp.sum(), z)
    results = run_world(_on_group, 2)
    for logp, ent, _ in results:
        torch.testing.assert_close(logp, want_logp.detach())
        torch.testing.assert_close(ent, want_ent.detach())
    local_grads = torch.cat([r[2] for r in results], dim=-1)  # d/d logits = d/d z / temperature
    torch.testing.assert_close(local_grads[..., :VOCAB], grad / 0.7)
    assert (local_grads[..., VOCAB:] == 0).all()
