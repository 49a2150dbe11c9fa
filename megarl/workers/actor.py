"""The actor and the reference policy: per-token log-probs of the batch's responses and the policy-loss update
(:class:`PolicyWorker`, a :class:`~megarl.workers.engine.MegatronWorker`), and a LoRA actor's reference, its own
base (:class:`BasePolicy`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from megarl.kernels.batch_invariant import batch_invariant_mode, vllm_logprobs
from megarl.kernels.chunked_logprobs import LogprobOutput
from megarl.kernels.context_parallel import next_tokens, split_for_cp_rank
from megarl.algos.aggregation import agg_loss
from megarl.algos.losses import actor_loss
from megarl.algos.registry import POLICY_LOSSES
from megarl.config import AlgorithmConfig
from megarl.data.batch import RolloutBatch, to_response_frame
from megarl.models.logprobs import vocab_parallel_logprobs
from megarl.models.lora import adapters_disabled
from megarl.models.router_replay import ROUTES, RouteReplay
from megarl.workers.engine import MODEL_INPUTS, MegatronWorker


class PolicyWorker(MegatronWorker):
    """The actor (trainable) or the reference policy (frozen): per-token log-probs and the PPO update.

    An MoE actor's passes read the batch's engine routes (``routed_experts``): :attr:`routes` replays them
    (``rc.moe.router_replay``) and measures the routing agreement of the old-log-prob pass
    (:meth:`routing_agreement`); None for a dense model and the reference policy.
    """

    def __init__(self, *args, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature
        self.routes = (RouteReplay(self.chunks, replay=self.rc.moe.router_replay)
                       if self.spec.is_moe and self.optimizer is not None else None)

    def _micro_batches(self, batch: RolloutBatch, names: tuple[str, ...], size: int, budget: int | None = None):
        """:meth:`~megarl.workers.engine.MegatronWorker._micro_batches`, with the batch's routes in each
        micro-batch, handed to :attr:`routes` (which finds each micro-batch of the passes that follow by its
        ``input_ids``)."""
        if self.routes is None:
            return super()._micro_batches(batch, names, size, budget)
        micro, rows = super()._micro_batches(batch, names + ((ROUTES,) if ROUTES in batch else ()), size, budget)
        self.routes.queue(micro)
        return micro, rows

    def routing_agreement(self) -> dict[str, float]:
        """The routing agreement between the engine and the old-log-prob passes since the last call
        (:meth:`~megarl.models.router_replay.RouteReplay.agreement`, over the role's pool: every rank of it
        calls); ``{}`` without routes."""
        return self.routes.agreement(self.pool_group) if self.routes is not None else {}

    def _model_kwargs(self, with_entropy: bool) -> dict[str, Any] | None:
        """With ``kernels.chunked_logprob`` the model itself returns ``(logprobs, entropy)``, computed in chunks
        of tokens from its last hidden states (:class:`megarl.kernels.chunked_logprobs.LogprobOutput`)."""
        k = self.rc.kernels
        if not k.chunked_logprob:
            return None
        return {"output_processor": LogprobOutput(vocab_size=self.spec.vocab_size, temperature=self.temperature,
                                                  with_entropy=with_entropy, chunk_tokens=k.logprob_chunk_tokens)}

    def _logprobs(self, mb, out, with_entropy: bool):
        """Response-frame ``[b, R]`` log-probs (and entropy) from the model output: vocab-parallel logits, or
        the ``(logprobs, entropy)`` of :meth:`_model_kwargs`' output processor."""
        if isinstance(out, tuple):
            logp, ent = out
        else:
            labels = next_tokens(mb["input_ids"])
            if self.cp_group is not None:
                labels = split_for_cp_rank(labels, 1, self.cp_group)
            logp, ent = vocab_parallel_logprobs(out, labels, vocab_size=self.spec.vocab_size,
                                                temperature=self.temperature, with_entropy=with_entropy)
        logp = self._cp_gather(logp)
        ent = self._cp_gather(ent) if with_entropy else None
        frame = functools.partial(to_response_frame, prompt_lens=mb["prompt_lens"],
                                  response_width=mb["response_mask"].shape[1], seq_offsets=mb.get("seq_offsets"))
        return frame(logp), (frame(ent) if with_entropy else None)

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False, *,
                         adapters: bool = True, exact: bool = False) -> dict[str, torch.Tensor]:
        """``{"logprobs": [B, R]}`` (and ``"entropy"``) of the batch's responses under this policy, fp32;
        ``adapters=False``: under a LoRA actor's base (its adapters off, :func:`~megarl.models.lora.
        adapters_disabled`); ``exact``: the batch-invariant pass of ``rollout.exact``
        (:meth:`~megarl.workers.engine.MegatronWorker.forward_response_frame`); in vLLM's mode its log-probs come
        from the model's whole logits as vLLM's sampler computes them (:func:`~megarl.kernels.batch_invariant.
        vllm_logprobs`), not from the chunked output layer."""
        names = ("logprobs", "entropy") if with_entropy else ("logprobs",)
        engine_logprobs = exact and not with_entropy and batch_invariant_mode()

        def fn(mb, logits):
            if engine_logprobs:
                logp = vllm_logprobs(logits, next_tokens(mb["input_ids"]), vocab_size=self.spec.vocab_size,
                                     temperature=self.temperature)
                return {"logprobs": to_response_frame(logp, mb["prompt_lens"], mb["response_mask"].shape[1])}
            logp, ent = self._logprobs(mb, logits, with_entropy)
            return {"logprobs": logp, "entropy": ent} if with_entropy else {"logprobs": logp}

        measure = self.routes.measuring() if self.routes is not None and adapters else contextlib.nullcontext()
        with contextlib.nullcontext() if adapters else adapters_disabled(self.chunks), measure:
            return self.forward_response_frame(batch, fn, names,
                                               None if engine_logprobs else self._model_kwargs(with_entropy),
                                               count_routes=adapters and self.optimizer is not None, exact=exact)

    def update(self, batch: RolloutBatch, alg: AlgorithmConfig, *, seed: int,
               norm_tokens: float | None = None, step: int | None = None) -> list[dict[str, float]]:
        """Policy-loss updates of the actor on ``batch`` (needs old_logprobs, advantages, loss_mask (the tokens
        in the loss: the response mask minus what overlong filtering, rollout correction and the non-finite
        rule leave out; without it, the response mask),
        rollout_weights when the rollout correction weighs tokens, and ref_logprobs when the KL is in the
        loss); ``norm_tokens``: the constant of ``loss_agg_mode=seq-mean-token-sum-norm``; ``step``: the RL
        step, for errors. Returns per-optimizer-step metrics: pg_loss, entropy, kl_loss, clipfrac,
        clipfrac_lower, ppo_kl, approx_kl (token means over the mini-batch), log_ratio_absmax (largest |log-prob
        - old log-prob|), grad_norm, lr.

        Without ``batch["old_logprobs"]`` (one epoch of one mini-batch: :mod:`megarl.trainer.old_logprobs`) the
        update's own detached log-probs are the old ones (the ratio exactly 1, with its gradient), and they are
        added to the batch as ``old_logprobs`` ``[B, R]`` float32 on every rank of the actor's pool.

        Raises:
            NonFiniteError: a loss or gradient that is not finite (:meth:`train_minibatches`).
            ValueError: no old log-probs with more than one epoch or mini-batch.
        """
        kl_in_loss = alg.kl.in_loss and alg.kl.coef > 0
        mask_name = "loss_mask" if "loss_mask" in batch else "response_mask"
        on_policy = "old_logprobs" not in batch
        names = (MODEL_INPUTS + (() if on_policy else ("old_logprobs",)) + ("advantages",)
                 + (("loss_mask",) if mask_name == "loss_mask" else ())
                 + (("ref_logprobs",) if kl_in_loss else ())
                 + (("rollout_weights",) if "rollout_weights" in batch else ()))
        params = POLICY_LOSSES.entry(alg.policy_loss).config_params(alg)

        def loss_fn(mb, logits, norms):
            logp, ent = self._logprobs(mb, logits, with_entropy=True)
            old = logp.detach() if on_policy else mb["old_logprobs"]
            loss, metrics = actor_loss(
                logp, old, mb["advantages"], mb[mask_name], policy_loss=alg.policy_loss,
                policy_loss_params=params, agg_mode=alg.loss_agg_mode, entropy=ent,
                entropy_coeff=alg.entropy_coef, ref_logprob=mb.get("ref_logprobs"),
                kl_coef=alg.kl.coef if kl_in_loss else 0.0, kl_kind=alg.kl.estimator,
                rollout_weights=mb.get("rollout_weights"), norm_tokens=norm_tokens, **norms)
            metrics["entropy"] = agg_loss(ent.detach(), mb[mask_name], "token-mean",
                                          global_tokens=norms["global_tokens"])
            if on_policy:
                metrics["old_logprobs"] = old
            return loss, metrics

        return self.train_minibatches(batch, names, loss_fn, epochs=self.rc.ppo_epochs, seed=seed,
                                      sum_keys=["pg_loss", "kl_loss", "entropy"],
                                      mean_keys=["clipfrac", "clipfrac_lower", "ppo_kl", "approx_kl"],
                                      max_keys=("log_ratio_absmax",), mask_name=mask_name,
                                      model_kwargs=self._model_kwargs(with_entropy=True), step=step,
                                      outputs=("old_logprobs",) if on_policy else ())


class BasePolicy:
    """The reference policy of a LoRA actor: the actor itself with its adapters off, so no second copy of the
    weights exists (the frozen base is the reference's weights, bit for bit).

    Args:
        actor: the LoRA actor's :class:`PolicyWorker`.
    """

    def __init__(self, actor: PolicyWorker):
        self.actor = actor

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`PolicyWorker.compute_logprobs` under the base."""
        return self.actor.compute_logprobs(batch, with_entropy, adapters=False)
