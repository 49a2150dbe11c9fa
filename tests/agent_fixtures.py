"""Fixtures of the agent tests: a small byte-level BPE tokenizer with ChatML chat templates of our own (Qwen's
turn format, with ``<tool_call>`` calls; one that drops the reasoning of earlier assistant turns, as Qwen3's
template does), and a scripted request-level engine whose "sampling" is a function of the prompt."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megarl.rollout.base import Completion, SamplingConfig

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the answer is here", "hello there", "tool call result", "<tool_call>", "</tool_call>", "name arguments",
          "think about it", "<think>", "</think>", "user assistant system tool", "0123456789 + - * / ( ) { } : , \""]

_CONTENT = "{{ m['content'] }}"
_TURNS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}" + _CONTENT +
          "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}{{ '\\n<tool_call>\\n' }}"
          "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
          "{{ '\\n</tool_call>' }}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_TOOLS = ("{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
          "{% endfor %}{{ '. Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
          "{% endif %}")
# ChatML with tools, append-only: every message as <|im_start|>role\ncontent<|im_end|>\n
CHATML = _TOOLS + _TURNS
# ChatML that keeps only the text after </think> of every assistant turn before the last one (not append-only)
CHATML_STRIP = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
                "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}" + _TOOLS + _TURNS.replace(_CONTENT, (
                    "{% if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in m['content'] %}"
                    "{{ m['content'].split('</think>')[-1].lstrip() }}{% else %}{{ m['content'] }}{% endif %}")))


def bpe_tokenizer(chat_template: str = CHATML):
    """A byte-level BPE tokenizer trained on :data:`CORPUS` (merges such as ``he``, ``the``), the ChatML special
    tokens, and ``chat_template``; EOS is ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat_template)


@dataclass
class _Spec:
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int = 4096


class ScriptedEngine:
    """A :class:`~megarl.rollout.base.RequestEngine` that answers each request with ``script(prompt_ids)`` (token
    ids; cut at the request's ``max_new_tokens``, finish "stop" when the last id is an EOS), log-prob ``-0.5``
    per token, one request finishing per :meth:`step` (so requests interleave). ``added`` records every
    request's prompt in order."""

    def __init__(self, script: Callable[[list[int]], Sequence[int]], eos_token_ids: Sequence[int],
                 context: int = 4096):
        self.script, self.spec = script, _Spec(tuple(eos_token_ids), context)
        self.queue: list[tuple[str, list[int], SamplingConfig]] = []
        self.added: list[list[int]] = []
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt_token_ids, sampling, seed):
        assert sampling.n == 1
        self.queue.append((request_id, list(prompt_token_ids), sampling))
        self.added.append(list(prompt_token_ids))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        request_id, prompt, sampling = self.queue.pop(0)
        ids = list(self.script(prompt))[:sampling.max_new_tokens]
        reason = "stop" if ids and ids[-1] in self.spec.eos_token_ids else "length"
        return [Completion(request_id, tuple(ids), torch.full((len(ids),), -0.5), reason)]
