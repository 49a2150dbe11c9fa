"""The Megatron actor's own decoding, the reference the GPU engine tests compare vLLM against: logits of one
sequence, greedy decoding by full forwards (no KV cache) and teacher-forced log-probs of a response."""

from __future__ import annotations

import torch

from megarl.models.spec import ModelSpec


def actor_logits(model, ids: list[int]) -> torch.Tensor:
    """The actor's logits ``[len(ids), padded_vocab]`` (its dtype) for one sequence."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, positions, None)[0]


def actor_greedy(model, spec: ModelSpec, prompt: list[int], steps: int) -> list[int]:
    """The actor's own greedy decoding of up to ``steps`` tokens (full forward per token), ending at
    ``spec``'s EOS like the engine."""
    ids, out = list(prompt), []
    for _ in range(steps):
        token = int(actor_logits(model, ids)[-1, :spec.vocab_size].float().argmax())
        out.append(token)
        ids.append(token)
        if token in spec.eos_token_ids:
            break
    return out


def actor_teacher_forced(model, spec: ModelSpec, prompt: list[int], response) -> torch.Tensor:
    """The actor's log-probs ``[len(response)]`` float32 (CPU) of each response token at temperature 1."""
    from megarl.models.logprobs import vocab_parallel_logprobs

    ids = list(prompt) + list(response)
    with torch.no_grad():
        logits = actor_logits(model, ids)[None]
        labels = torch.tensor([ids[1:] + [0]], device=logits.device)
        logp, _ = vocab_parallel_logprobs(logits, labels, vocab_size=spec.vocab_size)
    return logp[0, len(prompt) - 1:len(ids) - 1].float().cpu()


def gathered_logits_and_loss(targets: torch.Tensor, vocab_size: int, train: bool):
    """An output function of :func:`megarl.models.pipeline.run_microbatches` for the parity tests of a TP-split
    actor: ``{"logits": [b, s, vocab_size]}`` gathered over the TP ranks (vocab padding cut), and as the loss the
    cross-entropy of ``targets`` ``[b, s]`` (int64) when ``train``, zero (the same graph, times 0) otherwise."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def fn(mb, logits):
        full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
        loss = F.cross_entropy(full.reshape(-1, vocab_size), targets.reshape(-1))
        return (loss if train else loss * 0), {"logits": full.detach()}
    return fn
