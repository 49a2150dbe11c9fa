"""Batches of prompts over epochs, shuffled with a seed, resumable from a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from megarl.data.dataset import PromptDataset
from megarl.data.template import DataError


@dataclass(frozen=True)
class PromptBatch:
    """Prompts for one RL step.

    Attributes:
        input_ids: token ids of each prompt, unpadded (what a rollout engine's ``generate`` takes).
        index: each prompt's row number (0-based) in the source file.
        ground_truth: each prompt's ground truth (string) or None.
        raw_prompt: each prompt's text before templating (what reward functions receive as ``prompts``).
        rows: each prompt's source row (every field; what a multi-turn environment's ``reset`` gets), or None.
    """

    input_ids: list[list[int]]
    index: list[int]
    ground_truth: list[str | None]
    raw_prompt: list[str]
    rows: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def reward_inputs(self, samples: Sequence[Any], tokenizer: Any) -> tuple[list[str], list[str], list[str | None]]:
        """What a reward function takes for ``samples`` (rollout samples of these prompts, by ``prompt_index``):
        their prompts' texts, their responses decoded by ``tokenizer`` (special tokens skipped), the ground truths."""
        texts = tokenizer.batch_decode([list(s.token_ids) for s in samples], skip_special_tokens=True)
        return ([self.raw_prompt[s.prompt_index] for s in samples], texts,
                [self.ground_truth[s.prompt_index] for s in samples])


class PromptLoader:
    """Iterates over a :class:`PromptDataset` in batches, for a number of epochs.

    Epoch ``e`` visits the prompts in a permutation drawn from ``(seed, e)`` alone (or in order without
    shuffling), so the loader's whole state is ``(epoch, position)``: :meth:`state_dict` after the ``k``-th
    batch, given to :meth:`load_state_dict` of a fresh loader over the same data, makes it yield batch
    ``k + 1`` next. Iterating again continues where the last iteration stopped. Loaders built with the same
    arguments yield the same batches, so every data-parallel rank can build one and take its share of each
    batch.

    Args:
        dataset: the prompts.
        batch_size: prompts per batch (>= 1).
        shuffle: permute the prompts every epoch.
        seed: the shuffling seed.
        epochs: passes over the data (>= 1).
        drop_last: skip an epoch's last, incomplete batch.

    Raises:
        DataError: ``batch_size`` or ``epochs`` < 1, or fewer prompts than one batch with ``drop_last``.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 epochs: int = 1, drop_last: bool = True):
        if batch_size < 1 or epochs < 1:
            raise DataError(f"batch_size and epochs must be >= 1, got batch_size={batch_size}, epochs={epochs}")
        if drop_last and len(dataset) < batch_size:
            raise DataError(f"{dataset.source}: {len(dataset)} prompts are fewer than one batch of {batch_size} "
                            "(with drop_last); lower the batch size or add data")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0

    @staticmethod
    def epochs_for(prompts: int, batch_size: int, batches: int, drop_last: bool = True) -> int:
        """The epochs (>= 1) over ``prompts`` prompts that give at least ``batches`` batches of ``batch_size``
        (with ``drop_last`` an epoch gives ``prompts // batch_size``: 24 prompts in batches of 16 give one)."""
        per_epoch = prompts // batch_size if drop_last else -(-prompts // batch_size)
        return max(1, -(-batches // max(1, per_epoch)))

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        """Batches over all epochs (from the start, not from the current position)."""
        return self.steps_per_epoch * self.epochs

    def order(self, epoch: int) -> np.ndarray:
        """The dataset positions in the order epoch ``epoch`` visits them (``[len(dataset)]`` int64)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> Iterator[PromptBatch]:
        ds = self.dataset
        end = self.steps_per_epoch * self.batch_size if self.drop_last else len(ds)
        while self.epoch < self.epochs:
            order = self.order(self.epoch)
            while self.position < end:
                chosen = order[self.position:self.position + self.batch_size].tolist()
                self.position += len(chosen)
                yield PromptBatch(input_ids=[ds.input_ids[k] for k in chosen], index=[ds.index[k] for k in chosen],
                                  ground_truth=[ds.ground_truths[k] for k in chosen],
                                  raw_prompt=[ds.raw_prompts[k] for k in chosen], rows=[ds.rows[k] for k in chosen])
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position" (prompts of that epoch already yielded), "seed", "num_prompts"}``."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            DataError: the state came from another seed or another number of prompts (the order would differ).
        """
        if state["seed"] != self.seed or state["num_prompts"] != len(self.dataset):
            raise DataError(f"cannot resume the prompt loader: the checkpoint has seed={state['seed']} and "
                            f"{state['num_prompts']} prompts, this run seed={self.seed} and {len(self.dataset)} "
                            "prompts; use the same data, max_prompt_length and seed")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
