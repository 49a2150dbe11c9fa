"""How a dataset's prompt becomes the text the policy sees: system prompt, instruction, chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


class DataError(ValueError):
    """A dataset or data setting that megarl cannot use; the message names the file, row and field."""


@dataclass(frozen=True)
class PromptTemplate:
    """Turns a prompt into chat messages and renders them with the tokenizer's chat template.

    Attributes:
        system_prompt: a system message put first (unless the prompt's messages already start with one);
            None: none (the chat template may still add its default one, as SmolLM2's does).
        instruction: text appended to the (last) user message after a space, e.g.
            :data:`megarl.rewards.gsm8k.GSM8K_INSTRUCTION`; "" for none.
        use_chat_template: render with ``tokenizer.apply_chat_template`` (with the generation prompt, so the
            model answers as the assistant); False: the messages' contents joined by blank lines (for base
            models), tokenised with the tokenizer's special tokens (e.g. BOS).
    """

    system_prompt: str | None = None
    instruction: str = ""
    use_chat_template: bool = True

    def messages(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
        """The chat messages of a prompt: a string (one user message) or a list of ``{"role", "content"}``.

        Raises:
            DataError: a message list without a user message, or a message without role/content strings.
        """
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        else:
            msgs = [dict(m) for m in prompt]
            if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
                raise DataError(f"chat messages must be {{'role': str, 'content': str}} dicts, got {msgs!r:.200}")
        users = [k for k, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise DataError(f"a prompt needs a user message, got roles {[m['role'] for m in msgs]}")
        if self.instruction:
            msgs[users[-1]]["content"] = f"{msgs[users[-1]]['content']} {self.instruction}"
        if self.system_prompt is not None and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, tokenizer: Any, prompt: str | Sequence[Mapping[str, Any]]) -> str:
        """The full prompt text (special tokens included when the chat template writes them).

        Raises:
            DataError: ``use_chat_template`` with a tokenizer that has no chat template, or bad messages.
        """
        msgs = self.messages(prompt)
        if not self.use_chat_template:
            return "\n\n".join(m["content"] for m in msgs)
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("the tokenizer has no chat template; set data.use_chat_template=false (base models) or "
                            "use the instruct model's tokenizer")
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def tokenize(self, tokenizer: Any, prompts: Sequence[str | Sequence[Mapping[str, Any]]]) -> list[list[int]]:
        """Token ids of many prompts (one batched tokenizer call; no special tokens added on top of what the
        chat template writes).

        Raises:
            DataError: as :meth:`render`.
        """
        texts = [self.render(tokenizer, p) for p in prompts]
        if not texts:
            return []
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=not self.use_chat_template)["input_ids"]]
