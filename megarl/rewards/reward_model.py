"""Reward from a Hugging Face sequence-classification model (an outcome reward model, Ouyang et al. 2022).

Each (prompt, response) pair becomes one text: with the reward model's chat template (a user turn holding the
prompt, an assistant turn holding the response) when its tokenizer has one, else ``prompt + response``. The
texts are tokenised, cut to their last ``max_length`` tokens (the score is read at the end), right-padded and
scored in batches; the score is the model's logit ``label_index`` at the last non-pad token (the
``*ForSequenceClassification`` pooling rule of transformers).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from megarl.rewards.registry import RewardError, register_reward


@register_reward("reward_model")
class RewardModel:
    """Batched scoring with an ``AutoModelForSequenceClassification``.

    Args:
        model: a local directory (model and tokenizer, loaded with ``from_pretrained``; nothing is
            downloaded when it exists) or a loaded model.
        tokenizer: its tokenizer (required with a loaded model; default: loaded from ``model``).
        batch_size: texts per forward pass.
        max_length: tokens per text; longer texts keep their last ``max_length`` tokens.
        device: where the model runs (e.g. "cpu", "cuda:0").
        dtype: the weights' dtype when loading from a directory ("float32", "bfloat16", ...).
        chat_template: format pairs with the tokenizer's chat template; None: when it has one.
        label_index: which output logit is the score (0 for the usual single-label reward model).

    Raises:
        RewardError: a loaded model without its tokenizer, no pad or EOS token, ``label_index`` outside the
            model's labels, or ``chat_template=True`` for a tokenizer without one.
    """

    def __init__(self, model: str | os.PathLike | Any, tokenizer: Any | None = None, *, batch_size: int = 8,
                 max_length: int = 2048, device: str | torch.device = "cpu", dtype: str = "float32",
                 chat_template: bool | None = None, label_index: int = 0):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, (str, os.PathLike)):
            tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
            model = AutoModelForSequenceClassification.from_pretrained(model, dtype=getattr(torch, dtype))
        elif tokenizer is None:
            raise RewardError("RewardModel with a loaded model needs its tokenizer too (tokenizer=...)")
        if batch_size < 1 or max_length < 1:
            raise RewardError(f"batch_size and max_length must be >= 1, got {batch_size} and {max_length}")
        if not 0 <= label_index < model.config.num_labels:
            raise RewardError(f"label_index={label_index} but the reward model has "
                              f"{model.config.num_labels} labels")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise RewardError("the reward model's tokenizer has neither a pad nor an EOS token")
        if model.config.pad_token_id is None:
            model.config.pad_token_id = pad_id
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise RewardError("chat_template=True but the reward model's tokenizer has no chat template")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.chat_template = has_template if chat_template is None else chat_template
        self.label_index = label_index
        self.pad_id = model.config.pad_token_id

    def texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
        """The text that is scored for each (prompt, response) pair (module docstring)."""
        if not self.chat_template:
            return [p + r for p, r in zip(prompts, responses)]
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p},
                                                    {"role": "assistant", "content": r}], tokenize=False)
                for p, r in zip(prompts, responses)]

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 ground_truths: Sequence[str | None] | None = None) -> list[float]:
        """Score ``B`` responses (the reward-function signature; ``ground_truths`` is unused).

        Returns:
            ``B`` floats, the model's score of each pair.
        """
        texts = self.texts(prompts, responses)
        scores: list[float] = []
        device = next(self.model.parameters()).device
        for start in range(0, len(texts), self.batch_size):
            ids = self.tokenizer(texts[start:start + self.batch_size],
                                 add_special_tokens=not self.chat_template)["input_ids"]
            ids = [x[-self.max_length:] for x in ids]
            width = max(len(x) for x in ids)
            input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
            for k, x in enumerate(ids):
                input_ids[k, :len(x)] = torch.tensor(x)
                attention_mask[k, :len(x)] = 1
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            scores.extend(logits[:, self.label_index].float().tolist())
        return scores
