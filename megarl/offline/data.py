"""Offline training data: conversations as token ids with the assistant tokens marked, read from jsonl or parquet
files (or a ``datasets`` name when online); SFT examples and DPO preference pairs; their loader over epochs and
their batches in the RL step's :class:`~megarl.data.batch.RolloutBatch` form.

Masks come from the chat template's own rendering, never from re-tokenizing text (:func:`chat_tokens`): a template
with generation markers (``{% generation %}``) gives transformers' assistant-token mask; any other is rendered
prefix by prefix (``messages[:i]`` with the generation prompt, then ``messages[:i+1]``), and the tokens that the
assistant message ``i`` adds after its header are its tokens. A template whose renderings are not prefixes of one
another (one that rewrites earlier turns) is refused with the row named.

A row becomes one sequence ``prompt + response``: the prompt is every token before the first assistant token,
the response the rest; ``response_mask`` marks the assistant tokens within it (later user turns are context,
never trained on). So the actor's response-frame machinery (packing, CP, PP) serves unchanged.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from megarl.data.batch import RolloutBatch, build_batch
from megarl.data.dataset import read_rows
from megarl.data.loader import PromptLoader
from megarl.data.template import DataError

log = logging.getLogger(__name__)

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Tokens:
    """One conversation's tokens: ``ids`` (int) and ``mask`` (0/1, 1 on the assistant's tokens), of one length."""

    ids: list[int]
    mask: list[int]


def _render(tokenizer, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool = False, **kw) -> Any:
    return tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                         add_generation_prompt=generation_prompt, **kw)


def chat_tokens(tokenizer, messages: Sequence[Mapping[str, str]]) -> Tokens:
    """A conversation rendered by the tokenizer's chat template, its assistant messages' tokens marked.

    With generation markers in the template: ``apply_chat_template(..., return_assistant_tokens_mask=True)``.
    Otherwise assistant message ``i`` owns the tokens from the end of ``messages[:i]`` rendered with the generation
    prompt (its header) to the end of ``messages[:i+1]`` (its content and end-of-turn tokens).

    Raises:
        DataError: no chat template, no assistant message, an assistant message first, or a template whose
            rendering of a prefix is not a prefix of the next one's.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template, which message lists need; give prompt/completion "
                        "rows, or use an instruct model's tokenizer (model.tokenizer)")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DataError(f"a conversation needs an assistant message to train on, got roles {roles}")
    if roles[0] == "assistant":
        raise DataError(f"a conversation must not start with the assistant (nothing to condition on), got {roles}")
    if _GENERATION_MARKER.search(tokenizer.chat_template):
        out = _render(tokenizer, messages, return_assistant_tokens_mask=True)
        return Tokens(list(out["input_ids"]), [int(m) for m in out["assistant_masks"]])
    ids = list(_render(tokenizer, messages)["input_ids"])
    mask = [0] * len(ids)
    for i, role in enumerate(roles):
        if role != "assistant":
            continue
        start = list(_render(tokenizer, messages[:i], generation_prompt=True)["input_ids"])
        upto = list(_render(tokenizer, messages[:i + 1])["input_ids"])
        if ids[:len(start)] != start or ids[:len(upto)] != upto:
            raise DataError("the chat template does not render a conversation's beginning as a prefix of the whole "
                            f"(message {i} of roles {roles}): its assistant tokens cannot be told apart; use a "
                            "template with {% generation %} markers (model.tokenizer)")
        mask[len(start):len(upto)] = [1] * (len(upto) - len(start))
    return Tokens(ids, mask)


def completion_tokens(tokenizer, prompt: str, completion: str) -> Tokens:
    """A prompt and its completion for a tokenizer without a chat template: the prompt's tokens (with the
    tokenizer's special tokens, e.g. BOS), then the completion's and EOS, which are marked."""
    p = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not p:
        raise DataError(f"the prompt {prompt!r:.80} is no tokens: a completion needs a prompt to follow")
    c = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return Tokens(p + c, [0] * len(p) + [1] * len(c))


def _messages(value: Any, role: str, where: str) -> list[dict[str, str]]:
    """A field as chat messages: a string is one message of ``role``; a list must hold role/content strings."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: must be a string or a non-empty list of {{'role', 'content'}} messages, got "
                    f"{value!r:.120}")


class Conversations:
    """Turns a data row's fields into :class:`Tokens` (the chat template when the tokenizer has one).

    Args:
        tokenizer: a Hugging Face tokenizer.
        system_prompt: a system message put first where a conversation has none (None: none).
        section: the config section's name (``sft``, ``dpo``), for messages.
    """

    def __init__(self, tokenizer, system_prompt: str | None, section: str):
        self.tokenizer, self.system_prompt, self.section = tokenizer, system_prompt, section
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def tokens(self, prompt: Any, completion: Any, where: str) -> Tokens:
        """The tokens of ``prompt`` (a string, messages, or None when ``completion`` is the whole conversation)
        followed by ``completion`` (a string: one assistant message; or messages)."""
        if not self.chat:
            if not (isinstance(prompt, str) and isinstance(completion, str)):
                raise DataError(f"{where}: the tokenizer has no chat template, so rows must hold a text prompt and "
                                "completion; use an instruct model's tokenizer (model.tokenizer) for messages")
            return completion_tokens(self.tokenizer, prompt, completion)
        msgs = ([] if prompt is None else _messages(prompt, "user", where)) + _messages(completion, "assistant", where)
        if self.system_prompt is not None and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        try:
            return chat_tokens(self.tokenizer, msgs)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None


def read_source(files: Sequence[str], dataset: str | None, split: str, field: str) -> list[tuple[str, dict]]:
    """``(where, row)`` of every row of ``files`` (jsonl, parquet), or of the Hugging Face dataset ``dataset``'s
    ``split`` (needs the ``datasets`` package and the network); ``where`` names the file and row for messages.

    Raises:
        DataError: naming ``field``: no source, a missing file, or a dataset that cannot be loaded.
    """
    if dataset is not None:
        try:
            import datasets
        except ImportError:
            raise DataError(f"{field}: the dataset {dataset!r} needs the 'datasets' package (pip install "
                            "datasets) and the network; or give local jsonl/parquet files") from None
        try:
            rows = datasets.load_dataset(dataset, split=split)
        except Exception as e:  # noqa: BLE001 (offline, unknown name, gated: said in one line)
            raise DataError(f"{field}: cannot load the dataset {dataset!r} (split {split!r}): "
                            f"{' '.join(str(e).split())[:300]}; check the name and the network, or give local "
                            "files") from None
        return [(f"{dataset}[{split}] row {k}", dict(r)) for k, r in enumerate(rows)]
    if not files:
        raise DataError(f"{field}: no data; list jsonl or parquet files (or name a datasets dataset when online)")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise DataError(f"{field}: {missing} do not exist; check the paths (jsonl or parquet files of the rows "
                        "README.md's \"Offline training\" shows)")
    return [(f"{f} row {k}", r) for f in files for k, r in enumerate(read_rows(f))]


def _cut(t: Tokens, max_length: int) -> Tokens | None:
    """``t`` cut to ``max_length`` tokens; None when no assistant token is left."""
    t = Tokens(t.ids[:max_length], t.mask[:max_length])
    return t if any(t.mask) else None


def _field(row: Mapping[str, Any], key: str, where: str, setting: str) -> Any:
    if key not in row or row[key] is None:
        raise DataError(f"{where}: no field {key!r} (its fields: {sorted(row)}); set {setting} to the field that "
                        "holds it, or fix the row")
    return row[key]


def sft_examples(rows: Sequence[tuple[str, dict]], conv: Conversations, cfg) -> list[Tokens]:
    """SFT examples of ``rows``: a ``cfg.messages_key`` conversation, else ``cfg.prompt_key`` and
    ``cfg.completion_key``; each cut to ``cfg.max_length`` tokens (rows with no assistant token left are dropped,
    with a warning).

    Raises:
        DataError: a row without those fields or with bad messages; no example left.
    """
    out, dropped = [], 0
    for where, row in rows:
        if cfg.messages_key in row and row[cfg.messages_key] is not None:
            t = conv.tokens(None, row[cfg.messages_key], where)
        else:
            t = conv.tokens(_field(row, cfg.prompt_key, where, f"{conv.section}.prompt_key"),
                            _field(row, cfg.completion_key, where, f"{conv.section}.completion_key"), where)
        t = _cut(t, cfg.max_length)
        dropped += t is None
        if t is not None:
            out.append(t)
    return _kept(out, dropped, len(rows), cfg, conv.section)


def _kept(out: list, dropped: int, total: int, cfg, section: str) -> list:
    if not out:
        raise DataError(f"{section}.max_length: every one of {total} rows has no assistant token within the first "
                        f"{cfg.max_length} tokens; raise {section}.max_length")
    if dropped:
        log.warning("%s: dropped %d of %d rows with no assistant token within %s.max_length=%d tokens", section,
                    dropped, total, section, cfg.max_length)
    return out


def _prompt_and_ends(row: Mapping[str, Any], cfg, where: str) -> tuple[Any, Any, Any]:
    """A preference row's ``(prompt, chosen, rejected)``; without ``cfg.prompt_key``, chosen and rejected are
    whole conversations and the prompt is their longest common beginning (in messages)."""
    chosen = _field(row, cfg.chosen_key, where, "dpo.chosen_key")
    rejected = _field(row, cfg.rejected_key, where, "dpo.rejected_key")
    if cfg.prompt_key in row and row[cfg.prompt_key] is not None:
        return row[cfg.prompt_key], chosen, rejected
    c, r = _messages(chosen, "assistant", where), _messages(rejected, "assistant", where)
    k = 0
    while k < min(len(c), len(r)) - 1 and c[k] == r[k]:
        k += 1
    if k == 0:
        raise DataError(f"{where}: no field {cfg.prompt_key!r} (dpo.prompt_key) and the chosen and rejected "
                        "conversations share no first message to be the prompt")
    return c[:k], c[k:], r[k:]


def preference_pairs(rows: Sequence[tuple[str, dict]], conv: Conversations, cfg) -> list[tuple[Tokens, Tokens]]:
    """``(chosen, rejected)`` tokens of each preference row (:func:`_prompt_and_ends`), each cut to
    ``cfg.max_length`` (pairs where either has no assistant token left are dropped, with a warning).

    Raises:
        DataError: a row without the fields or with bad messages; no pair left.
    """
    out, dropped = [], 0
    for where, row in rows:
        prompt, chosen, rejected = _prompt_and_ends(row, cfg, where)
        pair = (_cut(conv.tokens(prompt, chosen, where), cfg.max_length),
                _cut(conv.tokens(prompt, rejected, where), cfg.max_length))
        dropped += None in pair
        if None not in pair:
            out.append(pair)
    return _kept(out, dropped, len(rows), cfg, conv.section)


class ExampleSet:
    """Examples (any list) as a :class:`~megarl.data.loader.PromptLoader` reads a dataset: its length and name."""

    def __init__(self, examples: list, source: str):
        self.examples, self.source = examples, source

    def __len__(self) -> int:
        return len(self.examples)


class ExampleLoader(PromptLoader):
    """:class:`~megarl.data.loader.PromptLoader`'s epochs, shuffle and resumable position over an
    :class:`ExampleSet`, yielding each batch's examples (a list) instead of prompts."""

    def __iter__(self) -> Iterator[list]:
        size = self.batch_size
        end = self.steps_per_epoch * size if self.drop_last else len(self.dataset)
        while self.epoch < self.epochs:
            order = self.order(self.epoch)
            while self.position < end:
                chosen = order[self.position:self.position + size].tolist()
                self.position += len(chosen)
                yield [self.dataset.examples[k] for k in chosen]
            self.epoch += 1
            self.position = 0


def to_batch(examples: Sequence[Tokens], *, pad_token_id: int, seq_multiple: int) -> RolloutBatch:
    """Examples as a :class:`~megarl.data.batch.RolloutBatch`: ``input_ids [B, S]``, ``prompt_lens [B]`` (the
    tokens before the first assistant token), ``response_lens [B]`` (the rest) and ``response_mask [B, R]``
    float32 (1 on the assistant's tokens of the response)."""
    starts = [t.mask.index(1) for t in examples]
    return build_batch([t.ids[:s] for t, s in zip(examples, starts)], [t.ids[s:] for t, s in zip(examples, starts)],
                       [torch.zeros(len(t.ids) - s) for t, s in zip(examples, starts)], list(range(len(examples))),
                       pad_token_id=pad_token_id, seq_multiple=seq_multiple,
                       response_masks=[t.mask[s:] for t, s in zip(examples, starts)])
