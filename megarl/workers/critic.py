"""The critic: per-token values of the batch's response positions and the clipped value-loss update
(:class:`CriticWorker`, a :class:`~megarl.workers.engine.MegatronWorker`)."""

from __future__ import annotations

import torch

from megarl.algos.losses import value_loss
from megarl.config import AlgorithmConfig
from megarl.data.batch import RolloutBatch, to_response_frame
from megarl.workers.engine import MODEL_INPUTS, MegatronWorker


class CriticWorker(MegatronWorker):
    """The value model: per-token values ``V(s_t)`` (the state before each response token) and its update."""

    def _values(self, mb, out):
        return to_response_frame(self._cp_gather(out.float()), mb["prompt_lens"], mb["response_mask"].shape[1],
                                 mb.get("seq_offsets"))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B, R]`` float32 values of the batch's response positions."""
        return self.forward_response_frame(batch, lambda mb, out: {"values": self._values(mb, out)},
                                           ("values",))["values"]

    def update(self, batch: RolloutBatch, alg: AlgorithmConfig, *, seed: int,
               norm_tokens: float | None = None, step: int | None = None) -> list[dict[str, float]]:
        """Clipped value-loss updates on ``batch`` (needs values (old), returns, and value_mask where samples
        leave the value loss (the response mask without the samples the non-finite rule drops; without it, the
        response mask)); ``norm_tokens`` and ``step`` as the actor's. Returns per-step metrics: vf_loss,
        vf_clipfrac, vpred_mean, grad_norm, lr.

        Raises:
            NonFiniteError: a loss or gradient that is not finite (:meth:`train_minibatches`).
        """
        mask_name = "value_mask" if "value_mask" in batch else "response_mask"
        names = MODEL_INPUTS + ("values", "returns") + (("value_mask",) if mask_name == "value_mask" else ())

        def loss_fn(mb, out, norms):
            loss, metrics = value_loss(self._values(mb, out), mb["values"], mb["returns"], mb[mask_name],
                                       cliprange_value=alg.value_clip, agg_mode=alg.loss_agg_mode,
                                       norm_tokens=norm_tokens, **norms)
            return loss * alg.vf_coef, metrics

        return self.train_minibatches(batch, names, loss_fn, epochs=self.rc.ppo_epochs, seed=seed,
                                      sum_keys=["vf_loss"], mean_keys=["vf_clipfrac", "vpred_mean"],
                                      mask_name=mask_name, step=step)
