"""``megarl sft``: supervised fine-tuning on conversations or prompt/completion pairs, the loss on the assistant's
tokens alone (:mod:`megarl.offline.data`), on the actor's engine at any layout (:mod:`megarl.offline.policy`).

Metrics by step: ``sft/loss`` (mean negative log-likelihood of the batch's assistant tokens, nats per token),
``sft/tokens`` (the assistant tokens trained on), ``sft/tokens_per_s`` (those over the step's seconds),
``actor/grad_norm``, ``actor/lr``, ``data/epoch``, ``time/step``; with validation rows,
``val/loss`` (the same mean over every validation row) before the first step, every ``sft.val_every`` steps and
after the last.
"""

from __future__ import annotations

import time
from typing import Any

from megarl.algos.aggregation import masked_sum
from megarl.config.offline import OfflineDataConfig
from megarl.offline.data import Conversations, Tokens, sft_examples, to_batch
from megarl.offline.trainer import OfflineTrainer


class SFTTrainer(OfflineTrainer):
    """An SFT run on this rank (:class:`~megarl.offline.trainer.OfflineTrainer`; examples are
    :class:`~megarl.offline.data.Tokens`)."""

    section = "sft"

    @classmethod
    def examples(cls, rows: list[tuple[str, dict]], conv: Conversations, sec: OfflineDataConfig) -> list[Tokens]:
        return sft_examples(rows, conv, sec)

    def step(self, examples: list[Tokens], more=None) -> dict[str, Any]:
        start = time.perf_counter()
        batch = to_batch(examples, pad_token_id=self.pad_id, seq_multiple=self.seq_multiple)
        m = self.actor.sft_update(batch, seed=self.step_seed(), step=self.state.step + 1)
        seconds = time.perf_counter() - start
        return {"sft/loss": m["loss"], "sft/tokens": m["tokens"], "sft/tokens_per_s": m["tokens"] / seconds,
                "actor/grad_norm": m["grad_norm"], "actor/lr": m["lr"], "data/epoch": self.loader.epoch,
                "time/step": seconds}

    def validate(self) -> dict[str, Any]:
        nll = tokens = 0.0
        for chunk, real in self.chunks(self.val):
            batch = to_batch(chunk, pad_token_id=self.pad_id, seq_multiple=self.seq_multiple)
            mask = batch["response_mask"].clone()
            mask[real:] = 0  # the copies that fill up the last chunk
            logp = self.actor.compute_logprobs(batch)["logprobs"]
            nll += float(masked_sum(-logp, mask))
            tokens += float(mask.sum())
        return {"val/loss": nll / tokens}
