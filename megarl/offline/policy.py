"""The offline losses on the actor's engine (:class:`OfflinePolicy`, a :class:`~megarl.workers.actor.PolicyWorker`):
the same model chunks, optimizer, micro-batching (fixed, by tokens, packed), TP/PP/DP/CP/EP/VPP and LoRA as
``megarl train``'s actor, with the SFT cross-entropy and the DPO loss instead of the policy loss.

Both losses are over the response frame of the batch (:func:`megarl.offline.data.to_batch`: the response is
everything after the first assistant token, ``response_mask`` its assistant tokens) at temperature 1.
"""

from __future__ import annotations

import torch

from megarl.algos.aggregation import agg_loss, masked_sum
from megarl.algos.dpo import dpo_loss
from megarl.data.batch import RolloutBatch
from megarl.workers.actor import PolicyWorker
from megarl.workers.engine import MODEL_INPUTS

DPO_WEIGHT = "dpo_weight"  # the batch's [B] float64 d(DPO loss)/d(sequence log-prob) of each row


class OfflinePolicy(PolicyWorker):
    """The actor trained offline; constructed as a :class:`~megarl.workers.actor.PolicyWorker` (``temperature``
    1.0, ``rc.ppo_mini_batch_size`` the rows of one optimizer step)."""

    def sft_update(self, batch: RolloutBatch, *, seed: int, step: int) -> dict[str, float]:
        """One optimizer step on the mean negative log-likelihood of the batch's assistant tokens:
        ``-sum(mask * log p) / sum(mask)`` over the whole batch (the normaliser the global token count, so the
        gradient is the same at every layout and micro-batching). Returns ``loss`` (that mean, nats per token),
        ``tokens``, ``grad_norm`` and ``lr``, identical on every rank.

        Raises:
            NonFiniteError: a loss or gradient that is not finite (the optimizer has not stepped).
        """
        def loss_fn(mb, out, norms):
            logp, _ = self._logprobs(mb, out, with_entropy=False)
            loss = agg_loss(-logp, mb["response_mask"], "token-mean", global_tokens=norms["global_tokens"])
            return loss, {}

        (m,) = self.train_minibatches(batch, MODEL_INPUTS, loss_fn, epochs=1, seed=seed, sum_keys=["loss"],
                                      mean_keys=[], model_kwargs=self._model_kwargs(with_entropy=False), step=step)
        return {**m, "tokens": float(batch["response_mask"].sum())}

    def sequence_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B]`` float32: each row's summed log-probability of its assistant tokens (no gradient), on every
        rank."""
        logp = self.compute_logprobs(batch)["logprobs"]
        return masked_sum(logp, batch["response_mask"], dim=-1)

    def dpo_update(self, batch: RolloutBatch, reference: torch.Tensor, beta: float, *, seed: int,
                   step: int) -> dict[str, float]:
        """One optimizer step on the DPO loss (:func:`megarl.algos.dpo.dpo_loss`) of ``N`` pairs: the batch's
        rows ``[0, N)`` are the chosen completions, rows ``[N, 2N)`` the rejected ones of the same pairs, and
        ``reference`` ``[2N]`` the reference policy's sequence log-probs of those rows.

        The loss couples the two rows of a pair, which micro-batching, packing and DP may put apart, so it is
        taken in two passes: a forward pass gives every row's sequence log-prob ``s_r``, from which the loss and
        ``w_r = dL/ds_r`` are computed in float64 on every rank; the update then back-propagates
        ``sum_r w_r * s_r``, whose gradient at these weights is the DPO loss's exactly (the chain rule), at any
        layout. Returns ``loss``, ``rewards_chosen``, ``rewards_rejected``, ``margin``, ``accuracy``,
        ``grad_norm`` and ``lr``, identical on every rank.

        Raises:
            NonFiniteError: a loss or gradient that is not finite (the optimizer has not stepped).
        """
        n = len(batch) // 2
        seqs = self.sequence_logprobs(batch).double().requires_grad_(True)
        ref = reference.double()
        loss, metrics = dpo_loss(seqs[:n], seqs[n:], ref[:n], ref[n:], beta)
        (weights,) = torch.autograd.grad(loss, seqs)
        batch[DPO_WEIGHT] = weights

        def loss_fn(mb, out, norms):
            logp, _ = self._logprobs(mb, out, with_entropy=False)
            w = mb[DPO_WEIGHT].to(logp.dtype)
            return masked_sum(logp * w[:, None], mb["response_mask"]), {}

        (m,) = self.train_minibatches(batch, MODEL_INPUTS + (DPO_WEIGHT,), loss_fn, epochs=1, seed=seed,
                                      sum_keys=[], mean_keys=[], model_kwargs=self._model_kwargs(with_entropy=False),
                                      step=step)
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}, **m}
