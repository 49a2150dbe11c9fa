"""Agentic RL: multi-turn episodes with tools and environments, token-exact across turns.

- :mod:`.tools`: tools (callables with JSON schemas) and running their calls with timeouts;
- :mod:`.parsers`: reading tool calls back from the text, per chat-template family;
- :mod:`.env`: the environment interface and the built-in environments;
- :mod:`.episode`: an episode's trained tokens (sampled ids kept as sampled, observations as the template
  renders them, splits where the template is not append-only);
- :mod:`.rollout`: the generation loop over a request-level engine and the episodes running on it;
- :mod:`.endpoint`: agents written as ordinary code, an async function on an OpenAI-compatible chat client
  served from the rollout engine, every call's ids recorded;
- :mod:`.calculator`: the safe calculator tool of the arithmetic and GSM8K tasks.
"""

from megarl.agents import calculator  # noqa: F401,E402  (registers the built-in tool)
