"""Tool-call parsers, one per chat-template family: what a model writes to call a tool, read back from its text.

The sampled text is decoded only to be read here; the trained tokens stay the sampled ones
(:mod:`megarl.agents.episode`). Each parser returns the calls it read and the call-like texts it could not read
(each such text becomes a ``malformed`` observation, :mod:`megarl.agents.tools`). ``rollout.multi_turn.
tool_parser=auto`` picks the family from the chat template (:func:`parser_for_template`), and
:func:`check_parser` refuses a parser that would not read the template's own rendering of a call, so a run
cannot train with tool calls that never fire (the fault of awslabs/agentcore-rl-toolkit PR #97: a parser that
never fired while the reward rose for another reason).

- ``hermes`` (Qwen2.5, Qwen3, Hermes; vLLM's ``hermes`` parser): ``<tool_call>{"name": N, "arguments": {...}}
  </tool_call>``, any number of them; an unclosed ``<tool_call>`` runs to the end of the text. The chat
  template renders the tools (``apply_chat_template(..., tools=[...])``).
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling; vLLM's ``llama3_json``): the message is one or more JSON
  objects ``{"name": N, "parameters": {...}}`` (or ``"arguments"``) separated by ``;``, after an optional
  ``<|python_tag|>``; a message that does not start with ``{`` calls nothing. The template renders the tools.
- ``plain`` (models whose template has no tools, such as SmolLM2-135M-Instruct's, which renders only each
  message's role and content): the tools are listed in the system message by :meth:`PlainParser.system_text`,
  and a call is a line ``CALL name(arguments)``, the arguments a JSON object or, for a tool of one required
  parameter, its text as is (``CALL calculator(12 * 7)``). A line that starts with ``CALL`` and is not such a
  call is malformed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Protocol, Sequence

from megarl.agents.tools import Tool, ToolCall
from megarl.algos.registry import Registry


class ParserError(ValueError):
    """A tool-call parser that does not fit the chat template (or an unknown parser name)."""


class ToolCallParser(Protocol):
    """Reads tool calls from an assistant message's text.

    Attributes:
        name: the parser's name (``rollout.multi_turn.tool_parser``).
        template_tools: the chat template renders the tools (``apply_chat_template(tools=...)``); False: the
            tools are described by :meth:`system_text` in the system message.
    """

    name: str
    template_tools: bool

    def parse(self, text: str, tools: Mapping[str, Tool]) -> tuple[list[ToolCall], list[str]]:
        """``(calls, malformed)``: the calls in ``text`` in order, and the call texts that could not be read."""

    def format_call(self, call: ToolCall) -> str:
        """The text of ``call`` as the model is asked to write it (parsing it gives ``call`` back)."""

    def system_text(self, tools: Sequence[Tool]) -> str:
        """The tools' description for the system message ("" where the template renders them)."""


def _call_from_object(obj: Any, text: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded JSON object ``{"name": str, <argument key>: object or JSON string}``, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args, text)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` (module docstring)."""

    name = "hermes"
    template_tools = True
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, Tool]) -> tuple[list[ToolCall], list[str]]:
        calls, malformed = [], []
        for m in self._call.finditer(text):
            body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            try:
                call = _call_from_object(json.loads(body), m.group(0), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                malformed.append(m.group(0))
            else:
                calls.append(call)
        return calls, malformed

    def format_call(self, call: ToolCall) -> str:
        return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': dict(call.arguments)})}\n</tool_call>"

    def system_text(self, tools: Sequence[Tool]) -> str:
        return ""


class Llama3JsonParser:
    """JSON calls ``{"name": ..., "parameters": {...}}`` separated by ``;`` (module docstring)."""

    name = "llama3_json"
    template_tools = True
    python_tag = "<|python_tag|>"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> tuple[list[ToolCall], list[str]]:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].lstrip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).rstrip()
        if not body.startswith("{"):
            return [], []
        calls, malformed, decoder, pos = [], [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return calls, malformed + [body[pos:]]
            call = _call_from_object(obj, body[pos:end], ("parameters", "arguments"))
            (calls.append(call) if call else malformed.append(body[pos:end]))
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return calls, malformed

    def format_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": dict(call.arguments)})

    def system_text(self, tools: Sequence[Tool]) -> str:
        return ""


class PlainParser:
    """``CALL name(arguments)`` lines, the tools described in the system message (module docstring)."""

    name = "plain"
    template_tools = False
    _line = re.compile(r"^[ \t]*CALL\b.*$", re.MULTILINE)
    _call = re.compile(r"CALL[ \t]+([A-Za-z_][\w.-]*)[ \t]*\((.*)\)[ \t.]*$", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, Tool]) -> tuple[list[ToolCall], list[str]]:
        calls, malformed = [], []
        for line in self._line.findall(text):
            m = self._call.match(line.strip())
            if m is None:
                malformed.append(line.strip())
                continue
            name, raw = m.group(1), m.group(2).strip()
            try:
                args = json.loads(raw) if raw.startswith("{") else None
            except json.JSONDecodeError:
                args = None
            if args is None:
                required = list((tools[name].parameters.get("required") or []) if name in tools else [])
                if raw.startswith("{") or len(required) != 1:
                    if name in tools:  # arguments it cannot read
                        malformed.append(line.strip())
                        continue
                    args = {}  # an unknown tool: said so by the runner
                else:
                    args = {required[0]: raw}
            calls.append(ToolCall(name, args, line.strip()))
        return calls, malformed

    def format_call(self, call: ToolCall) -> str:
        args = dict(call.arguments)
        inner = next(iter(args.values())) if len(args) == 1 and isinstance(next(iter(args.values())), str) \
            else json.dumps(args)
        return f"CALL {call.name}({inner})"

    def system_text(self, tools: Sequence[Tool]) -> str:
        lines = ["You can use these tools:"]
        for t in tools:
            params = ", ".join((t.parameters.get("properties") or {}).keys())
            lines.append(f"- {t.name}({params}): {t.description}")
        lines.append("To call a tool, write a line CALL name(arguments), for example "
                     f"{self.format_call(example_call(tools[0])) if tools else 'CALL name(...)'}. Its result comes "
                     "back in the next message. When you know the answer, write it without a call.")
        return "\n".join(lines)


PARSERS: Registry[type] = Registry("tool-call parser", "register_parser")
register_parser = PARSERS.register
PARSERS.register("hermes")(HermesParser)
PARSERS.register("llama3_json")(Llama3JsonParser)
PARSERS.register("plain")(PlainParser)


def load_parser(name: str, chat_template: str | None) -> ToolCallParser:
    """The parser ``name``: ``auto`` (:func:`parser_for_template` of ``chat_template``), a registered name, or a
    dotted path to a parser class of your own (the :class:`ToolCallParser` protocol), built without arguments.

    Raises:
        ParserError: an unknown name or path.
    """
    if name == "auto":
        name = parser_for_template(chat_template)
    return PARSERS.find(name, ParserError)()


def parser_for_template(chat_template: str | None) -> str:
    """The parser family of a chat template's text: ``hermes`` where it writes ``<tool_call>``, ``llama3_json``
    where it has Llama 3's ``<|python_tag|>`` or ``ipython`` role, else ``plain``."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "plain"


def example_call(t: Tool) -> ToolCall:
    """A call of ``t`` with a placeholder for each parameter (``"1 + 2"`` for a string, 1 for a number)."""
    props = t.parameters.get("properties") or {}
    values = {"string": "1 + 2", "integer": 1, "number": 1, "boolean": True}
    return ToolCall(t.name, {k: values.get(v.get("type"), "1 + 2") for k, v in props.items()})


def check_parser(parser: ToolCallParser, tools: Sequence[Tool], render_call) -> None:
    """Refuse a parser that would not read a call as the model is taught to write it: the chat template's own
    rendering of an assistant message with one structured call (``render_call(call) -> text``, the
    assistant's turn as the template writes it) where the template renders tools, else the parser's
    :meth:`~ToolCallParser.format_call`.

    Raises:
        ParserError: naming the text, the parser and the fix.
    """
    if not tools:
        return
    call = example_call(tools[0])
    text = render_call(call) if parser.template_tools else parser.format_call(call)
    got, _ = parser.parse(text, {t.name: t for t in tools})
    if [(c.name, dict(c.arguments)) for c in got] != [(call.name, dict(call.arguments))]:
        raise ParserError(f"rollout.multi_turn.tool_parser: the {parser.name!r} parser reads "
                          f"{[(c.name, dict(c.arguments)) for c in got]} from {text!r}, the chat template's own "
                          f"rendering of the call {call.name}({dict(call.arguments)}): its calls would never "
                          f"fire; set rollout.multi_turn.tool_parser to the template's family "
                          f"({', '.join(PARSERS.names())})")
