"""The run's progress on this rank (:class:`RunState`): held by the :class:`~megarl.trainer.trainer.Trainer`,
advanced by the loop (:mod:`megarl.trainer.loop`), saved and restored by the checkpoints
(:mod:`megarl.trainer.checkpointing`), which take it as an argument.

It follows torchtitan's ``Stateful`` pattern: :meth:`RunState.state_dict` gives what a checkpoint keeps of it and
:meth:`RunState.load_state_dict` puts it back. Its saved form is the ``step``, ``policy_version``, ``loader`` and
``kl_ctl`` fields of a checkpoint's ``megarl.json``, as every megarl has written them, so older checkpoints resume.
The trained roles' weights, optimizer state and LR schedules are the workers' (:mod:`megarl.workers`), and every
rank's RNG states the checkpoint's own (:func:`~megarl.trainer.checkpointing.rng_states`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.algos.kl import AdaptiveKLController, FixedKLController
from megarl.data.loader import PromptLoader


@dataclass
class RunState:
    """The run's progress on this rank.

    Saved (:meth:`state_dict`):
        loader: the prompt loader; its position is the data cursor (the prompts drawn, dynamic sampling's extra
            rounds included).
        kl_ctl: the KL controller; its coefficient changes with the run where it is adaptive.
        step: the steps trained (0 before the first).
        policy_version: the step whose weights the rollout engines hold (or last got).

    This session's (not saved):
        in_flight: a resume's batches in flight at the save (a rollout pool of its own): step -> (samples,
            version) on the training ranks, step -> None on the rollout ranks; :func:`~megarl.trainer.loop.
            fit_split` takes them.
        last_checkpoint: the newest checkpoint written or resumed from (None: none yet).
        saved_at: ``time.monotonic()`` of the last save (or of the loop's start): ``trainer.save_every_min``.
        resumed: the checkpoint, step and config changes of this session's resume (None: not resumed).
    """

    loader: PromptLoader
    kl_ctl: FixedKLController | AdaptiveKLController
    step: int = 0
    policy_version: int = 0
    in_flight: dict[int, Any] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    saved_at: float = 0.0
    resumed: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "policy_version", "loader", "kl_ctl"}`` as plain data (JSON). The policy version saved is
        the step: the checkpoint holds the weights of the step it was written after."""
        return {"step": self.step, "policy_version": self.step, "loader": self.loader.state_dict(),
                "kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint's ``megarl.json``; one without ``policy_version``, from an
        earlier megarl, holds the step's weights).

        Raises:
            DataError: the loader's state came from another seed or number of prompts
                (:meth:`~megarl.data.loader.PromptLoader.load_state_dict`).
        """
        self.loader.load_state_dict(state["loader"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.step = int(state["step"])
        self.policy_version = int(state.get("policy_version", self.step))
