"""The offline commands' configs: ``megarl sft`` (:class:`SFTRunConfig`, section ``sft``) and ``megarl dpo``
(:class:`DPORunConfig`, section ``dpo``). Each is a whole :class:`~megarl.config.run.Config` (``model``, ``actor``
for the layout, optimizer, micro-batches and LoRA, ``run``, ``trainer`` for checkpoints, resume and loggers) plus
its own section; the rollout, reward and algorithm sections are not read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.config.errors import _require_in_section
from megarl.config.run import Config, RunConfig


@dataclass
class OfflineDataConfig:
    """What the offline commands share: the data and the steps.

    Attributes:
        train_files / val_files: jsonl or parquet files (no ``val_files``: no validation).
        dataset: a Hugging Face ``datasets`` name instead of ``train_files`` (needs the network); its ``split``
            trains and ``val_split`` (if any) validates.
        messages_key / prompt_key: the fields of a row's conversation (a list of ``{"role", "content"}``
            messages) or of its prompt (a string: one user message; or messages).
        system_prompt: a system message put first where a conversation has none (null: none).
        max_length: tokens per sequence; longer ones are cut there (a row with no assistant token left is
            dropped, with a warning).
        batch_size: sequences (DPO: pairs) per optimizer step, global (over DP ranks).
        epochs: passes over the training rows (when ``steps`` is 0). steps: optimizer steps (0 = ``epochs``
            passes); they become ``trainer.steps``, which checkpoints and ``--resume`` read.
        shuffle: a new order of the rows every epoch (seeded by ``run.seed``).
        val_every: also validate after every ``val_every``-th step (0 = before the first and after the last).
    """

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    dataset: Optional[str] = None
    split: str = "train"
    val_split: Optional[str] = None
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    system_prompt: Optional[str] = None
    max_length: int = 1024
    batch_size: int = 16
    epochs: int = 1
    steps: int = 0
    shuffle: bool = True
    val_every: int = 0

    def __post_init__(self):
        _require_in_section(self.max_length >= 2, "max_length", f"must be >= 2 tokens, got {self.max_length}")
        _require_in_section(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        _require_in_section(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        _require_in_section(self.steps >= 0, "steps", f"must be >= 0 (0 = epochs), got {self.steps}")
        _require_in_section(self.val_every >= 0, "val_every", f"must be >= 0, got {self.val_every}")
        _require_in_section(not (self.dataset and self.train_files), "dataset",
                            "give either train_files or dataset, not both")


@dataclass
class SFTConfig(OfflineDataConfig):
    """``megarl sft``'s data (:class:`OfflineDataConfig`) and ``completion_key``: the field of a row's
    completion (a string: one assistant message; or messages) next to ``prompt_key``."""

    completion_key: str = "completion"


@dataclass
class DPOConfig(OfflineDataConfig):
    """``megarl dpo``'s data (:class:`OfflineDataConfig`; ``batch_size`` in pairs) and loss.

    Attributes:
        chosen_key / rejected_key: the fields of the preferred and the dispreferred completion (strings, or
            messages); without ``prompt_key`` in a row, both are whole conversations and their common first
            messages the prompt.
        beta: the DPO temperature (Rafailov et al. 2023, eq. 7), > 0.
    """

    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    beta: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        _require_in_section(self.beta > 0, "beta", f"must be > 0, got {self.beta}")


@dataclass
class SFTRunConfig(Config):
    """``megarl sft``: a :class:`~megarl.config.run.Config` and its ``sft`` section."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="sft"))
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class DPORunConfig(Config):
    """``megarl dpo``: a :class:`~megarl.config.run.Config` and its ``dpo`` section."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="dpo"))
    dpo: DPOConfig = field(default_factory=DPOConfig)
