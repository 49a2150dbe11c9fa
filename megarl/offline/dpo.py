"""``megarl dpo``: Direct Preference Optimization (Rafailov et al. 2023) on chosen/rejected pairs, on the actor's
engine at any layout (:meth:`megarl.offline.policy.OfflinePolicy.dpo_update`).

The reference policy is the start checkpoint (``model.path``): its sequence log-probs of every training and
validation pair are computed once, before the first update, and kept in the run folder (``dpo_reference.pt``,
written with the first step), from which a resumed run reads them.

Metrics by step: ``dpo/loss``, ``dpo/rewards_chosen``, ``dpo/rewards_rejected`` (the implicit rewards
``beta * log(pi / pi_ref)``, means over the pairs), ``dpo/margin`` (their difference), ``dpo/accuracy`` (pairs whose
chosen reward is the larger), ``actor/grad_norm``, ``actor/lr``, ``data/epoch``, ``time/step``; with validation
pairs, the same as ``val/...`` before the first step, every ``dpo.val_every`` steps and after the last.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from megarl.algos.dpo import dpo_loss
from megarl.config import ConfigError
from megarl.config.offline import OfflineDataConfig
from megarl.data.batch import RolloutBatch
from megarl.offline.data import Conversations, preference_pairs, to_batch
from megarl.offline.trainer import OfflineTrainer, Prepared
from megarl.output_folder import write_beside

REFERENCE_FILE = "dpo_reference.pt"


class DPOTrainer(OfflineTrainer):
    """A DPO run on this rank (:class:`~megarl.offline.trainer.OfflineTrainer`; an example is ``(index, chosen,
    rejected)``, index its position among the training (or validation) pairs)."""

    section = "dpo"
    rows_per_example = 2

    def __init__(self, prepared: Prepared):
        super().__init__(prepared)
        self.reference_path = self.run_dir / REFERENCE_FILE
        self.reference = self._reference()

    @classmethod
    def examples(cls, rows: list[tuple[str, dict]], conv: Conversations, sec: OfflineDataConfig) -> list:
        return [(k, c, r) for k, (c, r) in enumerate(preference_pairs(rows, conv, sec))]

    def _pair_batch(self, pairs: list) -> RolloutBatch:
        """Rows ``[0, n)`` the chosen completions of ``n`` pairs, rows ``[n, 2n)`` their rejected ones."""
        return to_batch([c for _, c, _ in pairs] + [r for _, _, r in pairs], pad_token_id=self.pad_id,
                        seq_multiple=self.seq_multiple)

    def _sequence_logprobs(self, pairs: list) -> torch.Tensor:
        """``[n, 2]`` float32: the current policy's sequence log-probs of each pair's chosen and rejected."""
        out = []
        for chunk, real in self.chunks(pairs):
            s = self.actor.sequence_logprobs(self._pair_batch(chunk))
            out.append(torch.stack([s[:len(chunk)], s[len(chunk):]], 1)[:real])
        return torch.cat(out)

    def _reference(self) -> dict[str, torch.Tensor]:
        """The reference's ``{"train": [N, 2], "val": [M, 2]}`` sequence log-probs: computed now (the weights are
        the start checkpoint's), or a resumed run's from :data:`REFERENCE_FILE`.

        Raises:
            ConfigError: a resumed run whose folder lacks the file, or whose pairs it does not fit.
        """
        want = {"train": len(self.loader.dataset), "val": len(self.val or [])}
        if self.state.step == 0:
            ref = {"train": self._sequence_logprobs(self.loader.dataset.examples)}
            ref["val"] = self._sequence_logprobs(self.val) if self.val else torch.zeros(0, 2)
            self._written = False
            return ref
        self._written = True
        if not self.reference_path.is_file():
            raise ConfigError(f"trainer.resume: {self.reference_path} (the reference policy's log-probs, written at "
                              "the run's first step) is missing; start the run over from model.path")
        ref = torch.load(self.reference_path)
        got = {k: len(v) for k, v in ref.items()}
        if got != want:
            raise ConfigError(f"trainer.resume: {self.reference_path} holds the reference of {got} pairs, the data "
                              f"now gives {want}: resume with the run's data (dpo.train_files, dpo.val_files, "
                              "dpo.max_length)")
        return ref

    def _write_reference(self) -> None:
        """Rank 0 writes :attr:`reference` into the run folder once (atomically), after the run's record of an
        earlier run was moved aside (:func:`~megarl.trainer.run_record.keep_earlier_record`)."""
        if self.rank == 0 and not self._written:
            write_beside(self.reference_path, lambda tmp: torch.save(self.reference, tmp), "dpo")
        self._written = True

    def step(self, pairs: list, more=None) -> dict[str, Any]:
        start = time.perf_counter()
        self._write_reference()
        ref = self.reference["train"][torch.tensor([k for k, _, _ in pairs])]
        m = self.actor.dpo_update(self._pair_batch(pairs), torch.cat([ref[:, 0], ref[:, 1]]), self.sec.beta,
                                  seed=self.step_seed(), step=self.state.step + 1)
        out = {f"dpo/{k}": m[k] for k in ("loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy")}
        return {**out, "actor/grad_norm": m["grad_norm"], "actor/lr": m["lr"], "data/epoch": self.loader.epoch,
                "time/step": time.perf_counter() - start}

    def validate(self) -> dict[str, Any]:
        policy, ref = self._sequence_logprobs(self.val).double(), self.reference["val"].double()
        loss, metrics = dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], self.sec.beta)
        return {"val/loss": float(loss), **{f"val/{k}": float(v) for k, v in metrics.items()}}
