"""Multi-turn episodes in the trainer (``rollout.multi_turn.enabled``): the agent built from the config, a step's
episodes, their training batch and scores, their metrics, and validation by episodes.

The batch holds one row per trained sample of an episode (:class:`~megarl.agents.episode.TokenSample`;
more than one where the history was split): prompt = the sample's prompt ids, response = its sampled and
observation ids, ``response_mask`` 1 on the sampled ids only, so the policy loss, the KL, the entropy and the
rollout correction see sampled tokens alone and the observations are context. Every row of an episode has the
episode's reward and the group of its prompt (``rollout.n`` episodes per prompt: the GRPO/RLOO group; a split
episode counts once per sample in its group's statistics). Where splits (or an episode without a trained token)
make the row count other than ``prompts x n``, the batch is padded with empty rows (``response_mask`` 0: no
loss, no gradient) to a whole number of mini-batches, and that step makes more optimizer updates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from megarl.agents.endpoint import AgentError, AgentFunction, load_agent, require_openai, \
    run_agent_episodes_data_parallel
from megarl.agents.env import EnvError, EnvironmentFactory, load_environment
from megarl.agents.episode import ChatRenderer
from megarl.agents.parsers import ParserError, check_parser, load_parser
from megarl.agents.rollout import EpisodeBatch, EpisodeSettings, WeightUpdate, run_episodes_data_parallel
from megarl.agents.tools import Tool, ToolError, load_tools
from megarl.config import Config, ConfigError
from megarl.data.batch import RolloutBatch, build_batch
from megarl.data.loader import PromptBatch
from megarl.data.template import PromptTemplate
from megarl.rollout.base import SamplingConfig
from megarl.trainer.validation import CORRECT_SCORE


@dataclass
class Agent:
    """What a run's episodes are made of.

    Attributes:
        renderer: the chat template with the tools, and the tool-call parser.
        env: builds each episode's environment (unused with ``function``).
        settings: turn and token budgets, timeouts, parallelism.
        template: how a row's prompt field becomes chat messages (``data.system_prompt``, ``data.instruction``).
        prompt_key: the rows' prompt field (``data.prompt_key``).
        function: the agent written as ordinary code (``rollout.multi_turn.agent``), or None.
        server: serve it over HTTP (``rollout.multi_turn.agent_server``).
    """

    renderer: ChatRenderer
    env: EnvironmentFactory
    settings: EpisodeSettings
    template: PromptTemplate
    prompt_key: str
    function: AgentFunction | None = None
    server: bool = False

    def prompt_messages(self, prompts: PromptBatch) -> list[list[dict[str, Any]]]:
        """Each prompt's chat messages (what :meth:`~megarl.agents.env.Environment.reset` gets as ``prompt``)."""
        return [self.template.messages(row[self.prompt_key]) for row in prompts.rows]


def build_agent(cfg: Config, tokenizer) -> Agent:
    """The run's :class:`Agent` (``rollout.multi_turn``), every part checked: tools found, the parser reads the
    chat template's own tool calls (:func:`~megarl.agents.parsers.check_parser`; for an agent function, of a
    one-parameter tool), the environment builds, or the agent function loads (and, served over HTTP, the
    ``openai`` package imports).

    Raises:
        ConfigError: no chat template, or naming the ``rollout.multi_turn`` field that fails.
    """
    mt = cfg.rollout.multi_turn
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("rollout.multi_turn.enabled: episodes are rendered with the model's chat template, and "
                          "this tokenizer has none; use an instruct model's tokenizer (model.tokenizer)")
    try:
        tools = load_tools(mt.tools)
        parser = load_parser(mt.tool_parser, tokenizer.chat_template)
        renderer = ChatRenderer(tokenizer, tools, parser)
        check_parser(parser, tools, renderer.render_call)
        env = load_environment(mt.env, mt.env_kwargs)
        function = load_agent(mt.agent) if mt.agent else None
        if function is not None:  # the agent's requests name their tools: check the parser on one of them
            probe = [Tool("lookup", lambda query: query, "Look a word up.",
                          {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})]
            check_parser(parser, probe, renderer.with_tools(probe).render_call)
            if mt.agent_server:
                require_openai()
    except (ToolError, ParserError, EnvError, AgentError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("rollout.") else f"rollout.multi_turn: {msg}") from e
    settings = EpisodeSettings(max_turns=mt.max_turns, max_turn_tokens=cfg.rollout.max_new_tokens,
                               max_episode_tokens=mt.max_episode_tokens, tool_timeout_s=mt.tool_timeout_s,
                               env_timeout_s=mt.env_timeout_s,
                               max_observation_tokens=mt.max_observation_tokens,
                               max_parallel_episodes=mt.max_parallel_episodes)
    template = PromptTemplate(system_prompt=cfg.data.system_prompt, instruction=cfg.data.instruction)
    return Agent(renderer, env, settings, template, cfg.data.prompt_key, function, mt.agent_server)


def generate_episodes(agent: Agent, engine, prompts: PromptBatch, sampling: SamplingConfig, group=None,
                      pause: WeightUpdate | None = None, gather: bool = True) -> EpisodeBatch:
    """``sampling.n`` episodes per prompt over the rollout data-parallel ``group``; the engine's call counter
    seeds every turn (the caller advances it). ``pause``: new weights taken between turns once due (in-flight
    updates, :mod:`megarl.parallel.in_flight`); ``gather=False``: this rank's share alone
    (:func:`~megarl.agents.rollout.gather_episodes` later)."""
    return _run(agent, engine, prompts, sampling, engine.calls, group, pause, gather)


def _run(agent: Agent, engine, prompts: PromptBatch, sampling: SamplingConfig, call: int, group,
         pause: WeightUpdate | None = None, gather: bool = True) -> EpisodeBatch:
    """The episodes of ``prompts``: the environment loop, or the agent function behind its chat endpoint."""
    if agent.function is not None:
        return run_agent_episodes_data_parallel(engine, agent.renderer, agent.function, prompts.rows,
                                                agent.prompt_messages(prompts), sampling, agent.settings, call=call,
                                                group=group, server=agent.server, pause=pause, gather=gather)
    return run_episodes_data_parallel(engine, agent.renderer, agent.env, prompts.rows, agent.prompt_messages(prompts),
                                      sampling, agent.settings, call=call, group=group, pause=pause, gather=gather)


def row_multiple(cfg: Config, uses_critic: bool) -> int:
    """The batch's row count is padded to a multiple of this: every trained role's mini-batch size."""
    return math.lcm(cfg.actor.ppo_mini_batch_size, *((cfg.critic.ppo_mini_batch_size,) if uses_critic else ()))


def episode_batch(prompts: PromptBatch, out: EpisodeBatch, tokenizer, *, pad_token_id: int, seq_multiple: int,
                  multiple: int) -> RolloutBatch:
    """The training batch of a step's episodes (module docstring).

    Meta (one entry per row): ``episode`` (index in ``out.episodes``; -1 on padding), ``env_reward`` (the
    episode's reward, or None: ``reward.fn`` scores it), ``response`` (the row's response decoded, for
    samples.jsonl), ``final_response`` (the episode's last assistant text, what ``reward.fn`` scores),
    ``finish_reason``, ``index``, ``token_versions`` (each response token's policy version, -1 on observations:
    :func:`~megarl.data.staleness.stamp_token_versions` takes them). With router replay the rows carry the
    routes of every token the engine ran: the prompt, each turn's sampled tokens and the observations (from the
    prefill of the turn after them), :attr:`~megarl.agents.episode.TokenSample.routed_experts`.
    """
    rows = [(i, s) for i, e in enumerate(out.episodes) for s in e.samples]
    with_tokens = {i for i, _ in rows}
    rows += [(i, None) for i in range(len(out.episodes)) if i not in with_tokens]  # nothing trained: one empty row
    rows += [(-1, None)] * (-len(rows) % multiple)
    pad = [pad_token_id]
    prompts_ids = [s.prompt_ids if s else pad for _, s in rows]
    responses = [s.response_ids if s else pad for _, s in rows]
    masks = [s.mask if s else [0] for _, s in rows]
    logprobs = [torch.tensor(s.logprobs if s else [0.0], dtype=torch.float32) for _, s in rows]
    spare = len(prompts) + 1  # padding rows: groups of their own
    groups = [out.episodes[i].prompt_index if i >= 0 else spare + k for k, (i, _) in enumerate(rows)]
    texts = tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)
    eps = [out.episodes[i] if i >= 0 else None for i, _ in rows]
    meta = {"episode": [i for i, _ in rows], "env_reward": [e.reward if e else 0.0 for e in eps],
            "response": texts, "final_response": [e.last_text if e else "" for e in eps],
            "finish_reason": [e.finish_reason if e else "stop" for e in eps],
            "index": [prompts.index[e.prompt_index] if e else -1 for e in eps],
            "token_versions": [s.versions if s else [] for _, s in rows]}
    routes = [s.routed_experts if s else None for _, s in rows]
    if any(r is not None for r in routes):  # padding rows: no route (NO_ROUTE), of the routes' shape
        empty = next(r for r in routes if r is not None)[:0]
        routes = [empty if r is None else r for r in routes]
    return build_batch(prompts_ids, responses, logprobs, groups, pad_token_id=pad_token_id, seq_multiple=seq_multiple,
                       meta=meta, response_masks=masks, routed_experts=routes)


def to_score(batch: RolloutBatch, prompts: PromptBatch, out: EpisodeBatch) -> tuple[list[str], list[str], list[Any]]:
    """``(prompts, responses, ground truths)`` for ``reward.fn``: the rows whose episode has no environment
    reward, each scored on its episode's last assistant message."""
    rows = [k for k, r in enumerate(batch.meta["env_reward"]) if r is None]
    group = [out.episodes[batch.meta["episode"][k]].prompt_index for k in rows]
    return ([prompts.raw_prompt[g] for g in group], [batch.meta["final_response"][k] for k in rows],
            [prompts.ground_truth[g] for g in group])


def fill_scores(batch: RolloutBatch, scored: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32 row scores: the environment's reward where there is one, ``scored`` (``reward.fn`` on the
    rows of :func:`to_score`, in order) elsewhere."""
    it = iter(scored.tolist())
    return torch.tensor([next(it) if r is None else float(r) for r in batch.meta["env_reward"]], dtype=torch.float32)


def episode_scores(prompts: PromptBatch, out: EpisodeBatch, score) -> torch.Tensor:
    """``[episodes]`` float32: each episode's reward, or where the environment gave none ``score(prompts,
    responses, ground truths)`` (``reward.fn``) on its last assistant message."""
    eps = out.episodes
    need = [k for k, e in enumerate(eps) if e.reward is None]
    scored = iter(score([prompts.raw_prompt[eps[k].prompt_index] for k in need], [eps[k].last_text for k in need],
                        [prompts.ground_truth[eps[k].prompt_index] for k in need]).tolist()) if need else iter(())
    return torch.tensor([next(scored) if e.reward is None else e.reward for e in eps], dtype=torch.float32)


def episode_metrics(batch: RolloutBatch, out: EpisodeBatch) -> dict[str, float]:
    """The step's ``agent/...`` figures (:meth:`~megarl.agents.rollout.EpisodeBatch.metrics`) and the reward
    figures per episode (``reward/mean``, ``reward/std``, ``reward/accuracy`` over episodes, not rows: a split
    episode counts once), ``agent/rows`` and ``agent/padding_rows``."""
    first = {}
    for k, i in enumerate(batch.meta["episode"]):
        if i >= 0:
            first.setdefault(i, k)
    rows = [first[i] for i in sorted(first)]
    scores = batch["scores"][rows]
    if "dropped" in batch:  # a score that is not finite (megarl.algos.nonfinite) is out of the figures
        scores = scores[~batch["dropped"][rows]]
    return {**out.metrics(), "reward/mean": scores.mean().item(), "reward/std": scores.std(unbiased=False).item(),
            "reward/accuracy": (scores >= CORRECT_SCORE).float().mean().item(), "agent/rows": float(len(batch)),
            "agent/padding_rows": float(sum(i < 0 for i in batch.meta["episode"]))}


def evaluate_episodes(agent: Agent, engine, prompts: PromptBatch, sampling: SamplingConfig, score, tokenizer,
                      group=None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Validation by episodes (:func:`megarl.trainer.validation.evaluate`'s contract): ``sampling.n`` episodes
    per prompt, scored as in training; metrics ``accuracy``, ``reward_mean``, ``response_length_mean`` (sampled
    tokens per episode), ``clip_ratio`` (episodes cut by a budget), ``pass@n``, ``num_prompts``, ``seconds`` and
    the ``agent/...`` figures (``tool_use_rate``, ``turns_mean``, ...); one record per episode."""
    start = time.perf_counter()
    calls = engine.calls
    out = _run(agent, engine, prompts, sampling, calls, group)
    eps = out.episodes
    scores = episode_scores(prompts, out, score)
    correct = (scores >= CORRECT_SCORE).reshape(len(prompts), sampling.n)
    metrics = {"accuracy": correct.float().mean().item(), "reward_mean": scores.mean().item(),
               "response_length_mean": float(np.mean([e.sampled_tokens for e in eps])),
               "clip_ratio": float(np.mean([e.finish_reason == "length" for e in eps])),
               "num_prompts": len(prompts), "seconds": time.perf_counter() - start,
               **{k.removeprefix("agent/"): v for k, v in out.metrics().items()
                  if k in ("agent/tool_use_rate", "agent/tool_calls_per_episode", "agent/turns_mean",
                           "agent/tool_errors")}}
    if sampling.n > 1:
        metrics[f"pass@{sampling.n}"] = correct.any(dim=1).float().mean().item()
    records = [{"index": prompts.index[e.prompt_index], "sample": e.sample_index,
                "prompt": prompts.raw_prompt[e.prompt_index], "response": transcript(e.messages),
                "ground_truth": prompts.ground_truth[e.prompt_index], "score": float(scores[k]),
                "correct": bool(scores[k] >= CORRECT_SCORE), "length": e.sampled_tokens, "finish_reason": e.end,
                "turns": e.turns, "tool_calls": e.tool_calls} for k, e in enumerate(eps)]
    return metrics, records


def transcript(messages: Sequence[dict[str, Any]]) -> str:
    """An episode's history after its first user message as ``role: content`` lines (samples.jsonl)."""
    first_user = next((k for k, m in enumerate(messages) if m.get("role") == "user"), -1)
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages[first_user + 1:])
