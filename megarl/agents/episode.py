"""One episode's tokens, exact across turns: the prompt's ids, the ids the engine sampled and the observations'
ids as the chat template renders them between turns; nothing sampled is ever decoded and encoded again.

The trained sequence of an episode (a :class:`TokenSample`) is built as the episode runs:

1. the first messages rendered by the chat template with the tools (add_generation_prompt) and encoded: the
   prompt (``prompt_ids``, not trained);
2. each turn, the sampled ids as the engine returned them, with their rollout log-probs (``mask`` 1); their
   text (decoded only to be read by the parser and the environment, and to render the next prompt) joins the
   history as the assistant message;
3. the observations: the history with the new messages is rendered again (add_generation_prompt), and the part
   of that text after the text already held is encoded and appended (``mask`` 0, log-prob 0): the assistant
   turn's end and separator as the template writes them (the ``\\n`` after Qwen's ``<|im_end|>``, which verl
   PR #6921 found dropped), the observation messages, and the next assistant header.

Step 3 needs the template to render the history append-only: the text held so far (the exact template text of
the prompt and of every observation, and the decoded sampled tokens) must be a prefix of the new rendering.
Where it is not (a template that drops the reasoning of earlier assistant turns, as Qwen3's does before the last
user message; a turn that ended on another EOS than the template's end-of-turn token; a tokenizer whose decode
does not concatenate), the episode is **split**: the sample so far is closed, and a new one starts whose prompt
is the new rendering encoded whole. All samples of an episode share its reward (``agent/samples_split`` counts
the splits). The encoded delta starts right after a special token (the end-of-turn token the model sampled)
almost always, where BPE merges cannot reach across, so it tokenises as it would in the full text.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from megarl.agents.parsers import ToolCallParser
from megarl.agents.tools import Tool, ToolCall

Message = dict[str, Any]


@dataclass
class TokenSample:
    """One trained sequence of an episode.

    Attributes:
        prompt_ids: the prompt (not trained; for the first sample, the first messages rendered).
        response_ids: everything after the prompt: sampled and observation tokens in order.
        mask: ``len(response_ids)`` ints, 1 on sampled tokens (trained), 0 on observation tokens.
        logprobs: ``len(response_ids)`` floats, the rollout log-prob of each sampled token, 0 on observations.
        versions: ``len(response_ids)`` ints, the policy version (step) of the weights that sampled each token
            (:attr:`~megarl.rollout.base.Completion.policy_version`; -1 where unknown), -1 on observations.
        routes: the engine's routes (router replay) of the sequence's tokens from position 0 on, in pieces:
            each request's rows past those already held (the prompt and observations from the prefill of the
            request that first ran them, sampled tokens from the decode that sampled them); :attr:`routed_experts`.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[Any] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """The whole sequence: prompt then response."""
        return self.prompt_ids + self.response_ids

    @property
    def routed_experts(self) -> Any:
        """``[tokens, layers, top_k]`` int16 routes of the sequence from position 0 (every token some request
        ran: all but the last sampled one), or None where no request recorded routes."""
        if not self.routes:
            return None
        import torch

        return torch.cat(self.routes)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, version: int | None = None,
               routes: Any = None) -> None:
        """Append sampled ids (with their log-probs, sampled by the weights of ``version``) or, with ``logprobs``
        None, observation ids. ``routes``: the request's ``[prompt + sampled - 1, layers, top_k]`` routes
        (:attr:`~megarl.rollout.base.Completion.routed_experts`, its prompt the sequence held before these ids):
        the rows past those already held are added."""
        self.response_ids += list(ids)
        self.mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        self.versions += [-1 if logprobs is None or version is None else int(version)] * len(ids)
        if routes is not None:
            held = sum(len(r) for r in self.routes)
            self.routes.append(routes[held:])


class ChatRenderer:
    """The model's chat template with the episode's tools, and its tokenizer's text <-> ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: the tools offered (rendered by the template where ``parser.template_tools``, else described in the
            system message by ``parser.system_text``).
        parser: the tool-call parser (:mod:`megarl.agents.parsers`).

    Episodes run on threads of their own (:mod:`megarl.agents.rollout`); the tokenizer is used under a lock.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], parser: ToolCallParser):
        self.tokenizer, self.tools, self.parser = tokenizer, list(tools), parser
        self._schemas = [t.schema() for t in tools] if tools and parser.template_tools else None
        self._lock = threading.Lock()

    def with_tools(self, tools: Sequence[Tool]) -> "ChatRenderer":
        """This renderer with other tools (an agent's request names its own), sharing the tokenizer's lock."""
        other = ChatRenderer(self.tokenizer, tools, self.parser)
        other._lock = self._lock
        return other

    def first_messages(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` with the plain parser's tool description in the system message (a new first message,
        or before the existing system message's text); as they are where the template renders the tools."""
        msgs = [dict(m) for m in messages]
        text = self.parser.system_text(self.tools) if self.tools else ""
        if not text:
            return msgs
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = f"{text}\n\n{msgs[0]['content']}"
        else:
            msgs.insert(0, {"role": "system", "content": text})
        return msgs

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template's text of ``messages`` (with the tools)."""
        with self._lock:
            return self.tokenizer.apply_chat_template(list(messages), tools=self._schemas, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (no special tokens added: the template writes them)."""
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids as they are (special tokens kept, no clean-up of spaces)."""
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_call(self, call: ToolCall) -> str:
        """The assistant's turn as the template writes an assistant message holding ``call`` as a structured
        tool call (what the model was trained to write; :func:`~megarl.agents.parsers.check_parser`)."""
        user = [{"role": "user", "content": "hi"}]
        assistant = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_0", "function": {"name": call.name, "arguments": dict(call.arguments)}}]}
        before = self.render(user, add_generation_prompt=True)
        after = self.render(user + [assistant], add_generation_prompt=False)
        return after[len(before):] if after.startswith(before) else after


class EpisodeTokens:
    """The token and text state of one episode (module docstring): its samples and its message history.

    Args:
        renderer: the chat template, tools and tokenizer.
        stop_token_ids: tokens that end a turn (the model's EOS tokens); a turn's last sampled token, when one
            of them, is left out of the assistant message's text (the template writes the turn's end itself).

    Attributes:
        messages: the history: first messages, then assistant messages (decoded text) and observations.
        samples: the trained sequences, more than one where the history was split.
        splits: how many times it was split.
    """

    def __init__(self, renderer: ChatRenderer, stop_token_ids: Sequence[int]):
        self.renderer = renderer
        self.stop = set(int(t) for t in stop_token_ids)
        self.messages: list[Message] = []
        self.samples: list[TokenSample] = []
        self.splits = 0
        self._held = ""  # the text of the current sample's ids
        self._stop_text = ""  # the text of the stop token that ended the last turn ("" where none did)

    @property
    def current(self) -> TokenSample:
        """The sample the next turn extends."""
        return self.samples[-1]

    def begin(self, messages: Sequence[Message]) -> list[int]:
        """Start from the first messages; returns the prompt ids."""
        self.messages = self.renderer.first_messages(messages)
        self._held = self.renderer.render(self.messages)
        self.samples = [TokenSample(self.renderer.encode(self._held))]
        return self.current.prompt_ids

    def add_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int | None = None,
                 routes: Any = None) -> str:
        """Append a turn's sampled ids (mask 1; sampled by the weights of ``version``, with the request's
        ``routes``: :meth:`TokenSample.append`) and its assistant message; returns the message's text (the
        decoded ids without a final stop token)."""
        ids = [int(t) for t in token_ids]
        self.current.append(ids, logprobs, version, routes)
        self._held += self.renderer.decode(ids)
        content = ids[:-1] if ids and ids[-1] in self.stop else ids
        self._stop_text = self.renderer.decode(ids[len(content):])
        text = self.renderer.decode(content)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def observation_ids(self, observations: Sequence[Message]) -> tuple[list[int], bool, int]:
        """What appending ``observations`` after the last assistant turn would add, without adding it: ``(ids,
        append_only, observed)``; the ids are the delta after the held text (append-only) or the whole new
        rendering (a split); ``observed`` counts the observation tokens alone, what
        ``rollout.multi_turn.max_episode_tokens`` counts: the delta's ids, or after a split the tokens of the
        new rendering after the last assistant turn's text (:meth:`_after_last_turn`), the same count for an
        append-only template and one that re-renders earlier turns."""
        observations = [dict(m) for m in observations]
        text = self.renderer.render(self.messages + observations)
        if text.startswith(self._held):
            ids = self.renderer.encode(text[len(self._held):])
            return ids, True, len(ids)
        return self.renderer.encode(text), False, len(self.renderer.encode(self._after_last_turn(observations)))

    def _after_last_turn(self, observations: list[Message]) -> str:
        """The text the template renders after the last assistant turn's content when ``observations`` follow it
        (less the stop token the model sampled to end the turn, which the turn holds): the common end of two
        renderings whose last assistant content differs in a final mark, rendered with the same history, so the
        template drops or keeps the earlier turns' reasoning as in the split's rendering."""
        *before, last = self.messages
        a, b = (self.renderer.render(before + [{**last, "content": last["content"] + mark}] + observations)
                for mark in ("\x01", "\x02"))
        common = next((k for k in range(min(len(a), len(b))) if a[-1 - k] != b[-1 - k]), min(len(a), len(b)))
        after = a[len(a) - common:]
        return after[len(self._stop_text):] if self._stop_text and after.startswith(self._stop_text) else after

    def add_observations(self, observations: Sequence[Message], ids: list[int], append_only: bool) -> None:
        """Append the observation messages with their ids from :meth:`observation_ids` (mask 0), or start a new
        sample whose prompt they are (a split)."""
        self.messages += [dict(m) for m in observations]
        self._held = self.renderer.render(self.messages)
        if append_only:
            self.current.append(ids, None)
        else:
            self.samples.append(TokenSample(ids))
            self.splits += 1

    @property
    def trained_samples(self) -> list[TokenSample]:
        """The samples with at least one sampled token (a sample opened by a split just before the episode
        ended has none)."""
        return [s for s in self.samples if any(s.mask)]


def samples_from_calls(calls: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float], int | None, Any]]
                       ) -> list[TokenSample]:
    """The trained samples of an episode recorded as engine calls ``(prompt_ids, sampled_ids, logprobs, policy
    version, routes)`` in order (an agent that renders its own prompts, e.g. behind an OpenAI-compatible
    endpoint; version and routes as :class:`~megarl.rollout.base.Completion` has them): a call whose
    prompt begins with the previous call's prompt and sampled ids extends that sample, the prompt's new ids as
    observation tokens (mask 0); any other call starts a new sample (the token-level form of the split in the
    module docstring)."""
    samples: list[TokenSample] = []
    for prompt, sampled, logprobs, version, routes in calls:
        prompt = [int(t) for t in prompt]
        if samples and prompt[:len(samples[-1].ids)] == samples[-1].ids:
            samples[-1].append(prompt[len(samples[-1].ids):], None)
        else:
            samples.append(TokenSample(prompt))
        samples[-1].append([int(t) for t in sampled], logprobs, version, routes)
    return samples
