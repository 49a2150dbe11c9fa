"""Multi-turn episodes (:mod:`megarl.agents`): token exactness across turns, splits where the template is not
append-only, failing tools as observations and metrics, episodes that do not wait for each other, the parsers,
the calculator, and the masks of the policy loss. A scripted engine (:mod:`tests.agent_fixtures`) stands for
the model, so every token is known."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from megarl.agents.calculator import CalculatorError, evaluate
from megarl.agents.env import EnvironmentFactory, StepResult, ToolEnvironment
from megarl.agents.episode import ChatRenderer, samples_from_calls
from megarl.agents.parsers import HermesParser, Llama3JsonParser, ParserError, PlainParser, check_parser, load_parser
from megarl.agents.rollout import EpisodeSettings, run_episodes
from megarl.agents.tools import ToolCall, load_tool, tool
from megarl.rollout.base import SamplingConfig
from tests.agent_fixtures import CHATML, CHATML_STRIP, ScriptedEngine, bpe_tokenizer

CALC = load_tool("calculator")
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(CHATML)


def _turns(prompt: list[int], tok) -> int:
    """How many assistant turns a prompt holds already (the script's turn counter)."""
    return tok.decode(prompt).count("<|im_start|>assistant") - 1


def _run(tok, script, *, tools=(), env=ToolEnvironment, n=1, prompts=None, settings=None, template=None, **kw):
    tokenizer = tok if template is None else bpe_tokenizer(template)
    engine = ScriptedEngine(lambda p: script(p, _turns(p, tokenizer)), [tokenizer.eos_token_id], **kw)
    renderer = ChatRenderer(tokenizer, list(tools), load_parser("auto", tokenizer.chat_template))
    prompts = prompts or [USER]
    out = run_episodes(engine, renderer, env if isinstance(env, EnvironmentFactory) else EnvironmentFactory("e", env),
                       [{}] * len(prompts), prompts, SamplingConfig(n=n, max_new_tokens=64, seed=1),
                       settings or EpisodeSettings(max_turns=4, max_turn_tokens=400))
    return out, engine, renderer


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class Feedback:
    """Answers every turn with a user message "again" until the third turn."""

    def reset(self, row, prompt):
        return prompt

    def step(self, turn):
        return StepResult(done=True) if turn.turn == 2 else StepResult([{"role": "user", "content": "again"}])


def test_trained_ids_are_the_sampled_ids_where_decode_then_encode_differs(tok):
    sampled = tok.convert_tokens_to_ids(["t", "h", "e"]) + [tok.eos_token_id]  # decodes to "the" + <|im_end|>
    assert _ids(tok, tok.decode(sampled)) != sampled  # re-encoding merges "t h e" into other ids
    out, engine, _ = _run(tok, lambda p, t: sampled, env=Feedback)
    (episode,) = out.episodes
    (sample,) = episode.samples
    k = len(sample.prompt_ids)
    assert sample.response_ids[:len(sampled)] == sampled and sample.mask[:len(sampled)] == [1] * len(sampled)
    assert sample.logprobs[:len(sampled)] == [-0.5] * len(sampled)
    # every later turn's prompt holds the sampled ids as sampled, not re-encoded text
    for turn in (1, 2):
        assert engine.added[turn][k:k + len(sampled)] == sampled
    assert sum(sample.mask) == 3 * len(sampled) and episode.turns == 3 and episode.end == "done"


class _Stamping(ScriptedEngine):
    """:class:`ScriptedEngine` stamping each completion with its ``policy_version`` (a real engine's weights)."""

    policy_version = 0
    finished = 0

    def step(self):
        done = [dataclasses.replace(c, policy_version=self.policy_version) for c in super().step()]
        self.finished += len(done)
        return done


class _NewWeightsAfterTheFirstTurn:
    """In-flight weights (:class:`megarl.agents.rollout.WeightUpdate`) due once a turn has finished: version 1."""

    def __init__(self, engine):
        self.engine, self.running_at_update = engine, None

    def due(self):
        return self.engine.finished >= 1 and self.running_at_update is None

    def __call__(self):
        self.running_at_update = self.engine.has_unfinished_requests()
        self.engine.policy_version = 1


def test_weights_updated_in_flight_take_effect_between_turns_and_each_token_keeps_its_version(tok):
    """Issue 44: new weights come after the first turn of a three-turn episode: no request runs while they are
    written, the later turns are sampled by them, and every sampled token carries the version that sampled it."""
    engine = _Stamping(lambda p: _ids(tok, "hello there") + [tok.eos_token_id], [tok.eos_token_id])
    pause = _NewWeightsAfterTheFirstTurn(engine)
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    out = run_episodes(engine, renderer, EnvironmentFactory("e", Feedback), [{}], [USER],
                       SamplingConfig(n=1, max_new_tokens=64, seed=1), EpisodeSettings(max_turns=4), pause=pause)
    (sample,) = out.episodes[0].samples
    turn = len(_ids(tok, "hello there")) + 1
    sampled = [v for v, m in zip(sample.versions, sample.mask) if m]
    assert pause.running_at_update is False and out.episodes[0].turns == 3
    assert sampled == [0] * turn + [1] * 2 * turn  # the first turn on the old weights, the others on the new
    assert all(v == -1 for v, m in zip(sample.versions, sample.mask) if not m)  # observations: no version


def _calls_script(tok):
    calls = [json.dumps({"name": "calculator", "arguments": {"expression": e}}) for e in ("1+2", "3*4")]
    answers = [f"<tool_call>\n{c}\n</tool_call>" for c in calls] + ["the answer is 12"]
    return lambda p, t: _ids(tok, answers[t]) + [tok.eos_token_id]


def test_three_turn_episode_is_the_templates_rendering_of_its_history(tok):
    out, engine, renderer = _run(tok, _calls_script(tok), tools=[CALC])
    (episode,) = out.episodes
    assert episode.end == "done" and episode.turns == 3 and episode.tool_calls == 2 and episode.splits == 0
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["3", "12"]
    (sample,) = episode.samples
    rendered = _ids(tok, renderer.render(episode.messages, add_generation_prompt=False))
    assert rendered[:len(sample.ids)] == sample.ids  # the whole history as the template renders it ...
    assert tok.decode(rendered[len(sample.ids):]) == "\n"  # ... but the separator after the last turn's end
    # mask 1 exactly on the three turns' sampled ids; each observation starts with the separator after <|im_end|>
    script = _calls_script(tok)
    turns = [script(None, t) for t in range(3)]
    runs, pos = [], 0
    for t, ids in enumerate(turns):
        start = sample.response_ids.index(ids[0], pos)
        assert sample.response_ids[start:start + len(ids)] == ids and sample.mask[start:start + len(ids)] == [1] * len(ids)
        runs.append((start, start + len(ids)))
        pos = start + len(ids)
    assert sum(sample.mask) == sum(len(t) for t in turns)
    for (_, end), (nxt, _) in zip(runs, runs[1:]):
        assert sample.mask[end:nxt] == [0] * (nxt - end) and sample.logprobs[end:nxt] == [0.0] * (nxt - end)
        assert tok.decode(sample.response_ids[end:end + 1]) == "\n"  # verl PR #6921's dropped separator is here
    # each turn's prompt extends the last one (what vLLM's prefix cache reuses)
    for before, after in zip(engine.added, engine.added[1:]):
        assert after[:len(before)] == before


def test_a_history_the_template_does_not_render_append_only_is_split(tok):
    answers = ["<think>first</think>" + a for a in ("<tool_call>\n" + json.dumps(
        {"name": "calculator", "arguments": {"expression": "1+2"}}) + "\n</tool_call>", "<tool_call>\n" + json.dumps(
        {"name": "calculator", "arguments": {"expression": "3*4"}}) + "\n</tool_call>", "the answer is 12")]
    strip = bpe_tokenizer(CHATML_STRIP)
    out, _, renderer = _run(strip, lambda p, t: _ids(strip, answers[t]) + [strip.eos_token_id], tools=[CALC],
                            template=CHATML_STRIP)
    (episode,) = out.episodes
    assert episode.end == "done" and episode.turns == 3 and episode.splits == 1
    assert out.metrics()["agent/samples_split"] == 1
    first, second = episode.samples
    msgs = episode.messages  # user, assistant, tool, assistant, tool, assistant (+ tools' system message)
    k = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    # the first sample: turns 1 and 2 appended (turn 1's reasoning still shown after its tool's answer, while it
    # is the last assistant turn)
    turn2 = _ids(strip, answers[1]) + [strip.eos_token_id]
    assert first.ids == _ids(strip, renderer.render(msgs[:k[1]], add_generation_prompt=True)) + turn2
    assert sum(first.mask) == sum(len(_ids(strip, a)) + 1 for a in answers[:2])
    # the second: a new prompt, the history as rendered once turn 1's reasoning is dropped, then turn 3
    assert second.prompt_ids == _ids(strip, renderer.render(msgs[:k[2]], add_generation_prompt=True))
    assert "first" not in strip.decode(second.prompt_ids).split("<|im_start|>assistant")[1]
    assert second.response_ids == _ids(strip, answers[2]) + [strip.eos_token_id] and all(second.mask)


def test_failing_tools_are_observations_and_counted_metrics(tok):
    gate = threading.Event()

    @tool(description="never answers in time")
    def hang() -> str:
        gate.wait(30)
        return "late"

    @tool(description="raises")
    def explode() -> str:
        raise RuntimeError("boom")

    @tool(description="answers too much")
    def chatty() -> str:
        return "the answer " * 200

    calls = [{"name": "hang", "arguments": {}}, {"name": "explode", "arguments": {}},
             {"name": "chatty", "arguments": {}}, {"name": "nope", "arguments": {}},
             {"name": "calculator", "arguments": {"x": 1}}, {"name": "calculator", "arguments": {"expression": "1/0"}}]
    first = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls) + "<tool_call>\n{not json"
    script = [first, "the answer is 1"]
    try:
        out, _, _ = _run(tok, lambda p, t: _ids(tok, script[t]) + [tok.eos_token_id],
                         tools=[hang, explode, chatty, CALC],
                         settings=EpisodeSettings(max_turns=3, max_turn_tokens=1000, tool_timeout_s=0.3,
                                                  max_observation_tokens=150))
    finally:
        gate.set()
    (episode,) = out.episodes
    assert episode.end == "done" and episode.turns == 2 and episode.tool_calls == 6
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert "timed out after 0.3 s" in results[0] and results[1] == "error: RuntimeError: boom"
    assert results[2].endswith(f"[truncated: {len(_ids(tok, 'the answer ' * 200))} tokens]") and "unknown tool 'nope'" in results[3]
    assert "bad arguments" in results[4] and "CalculatorError: division by zero" in results[5]
    assert "could not read the tool call" in results[6]
    m = out.metrics()
    assert {k.rsplit("/", 1)[1]: m[k] for k in m if k.startswith("agent/tool_errors/")} == {
        "unknown_tool": 1, "bad_arguments": 1, "exception": 2, "timeout": 1, "malformed": 1, "truncated": 1}
    assert m["agent/tool_errors"] == 7 and m["agent/tool_use_rate"] == 1.0 and m["agent/tool_calls_per_episode"] == 6


def test_a_failing_environment_ends_its_episode_only(tok):
    class Broken(ToolEnvironment):
        def step(self, turn):
            if self.rng is not None and turn.text.startswith("hello"):
                raise ValueError("broken")
            return StepResult(reward=1.0, done=True)

    script = {"a": "hello", "b": "the answer"}
    out, _, _ = _run(tok, lambda p, t: _ids(tok, script[tok.decode(p).split("user\n")[1][0]]) + [tok.eos_token_id],
                     env=Broken, prompts=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    broken, fine = out.episodes
    assert (broken.end, broken.reward, fine.end, fine.reward) == ("env_error", 0.0, "done", 1.0)
    assert out.metrics()["agent/ended/env_error"] == 0.5


def test_an_episode_goes_on_while_another_waits_for_its_tool(tok):
    """Episode 0's tool answers only once episode 1 has finished all its turns: were the episodes stepped in
    lockstep (every episode waiting for the slowest between turns), episode 0's tool would time out."""
    finished = threading.Event()

    @tool(description="waits for the other episode")
    def wait() -> str:
        return "done" if finished.wait(20) else "timed out"

    class Env(ToolEnvironment):
        def step(self, turn):
            result = super().step(turn)
            if turn.turn == 2 and turn.text == "the answer":
                finished.set()
            return result

    scripts = {"a": ["<tool_call>\n{\"name\": \"wait\", \"arguments\": {}}\n</tool_call>", "the answer"],
               "b": ["<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}\n</tool_call>"] * 2
               + ["the answer"]}

    def script(p, t):
        return _ids(tok, scripts[tok.decode(p).split("user\n")[1][0]][t]) + [tok.eos_token_id]

    out, _, _ = _run(tok, script, tools=[wait, CALC], env=Env,
                     prompts=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                     settings=EpisodeSettings(max_turns=4, max_turn_tokens=400, tool_timeout_s=30))
    a, b = out.episodes
    assert b.turns == 3 and a.turns == 2
    assert [m["content"] for m in a.messages if m["role"] == "tool"] == ["done"]


def test_turn_and_episode_budgets_and_the_turn_limit(tok):
    long = _ids(tok, "the answer is here and there") + [tok.eos_token_id]
    out, _, _ = _run(tok, lambda p, t: long, env=Feedback,
                     settings=EpisodeSettings(max_turns=4, max_turn_tokens=4, max_episode_tokens=0))
    (e,) = out.episodes
    assert e.turns == 3 and e.turns_cut == 3 and e.end == "done" and all(len(ids) == 4 for ids in [
        e.samples[0].response_ids[:4]]) and e.finish_reason == "length"
    out, _, _ = _run(tok, lambda p, t: long, env=Feedback,
                     settings=EpisodeSettings(max_turns=4, max_turn_tokens=64, max_episode_tokens=len(long) + 3))
    (e,) = out.episodes
    assert e.end == "episode_budget" and e.turns == 1  # the observation would pass the budget
    out, _, _ = _run(tok, lambda p, t: long, env=Feedback, settings=EpisodeSettings(max_turns=2, max_turn_tokens=64))
    assert out.episodes[0].end == "max_turns" and out.episodes[0].turns == 2
    assert out.metrics()["agent/ended/max_turns"] == 1.0


def test_parsers_read_their_families_and_refuse_a_template_they_do_not_fit(tok):
    tools = {"calculator": CALC}
    hermes = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+2\"}}\n</tool_call> <tool_call>x"
    assert HermesParser().parse(hermes, tools) == ([ToolCall("calculator", {"expression": "1+2"}, hermes[:-13])],
                                                   ["<tool_call>x"])
    llama = "<|python_tag|>{\"name\": \"calculator\", \"parameters\": {\"expression\": \"2\"}}; {\"name\": 3}"
    calls, bad = Llama3JsonParser().parse(llama, tools)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2"})] and bad == ['{"name": 3}']
    assert Llama3JsonParser().parse("The answer is {5}.", tools) == ([], [])
    calls, bad = PlainParser().parse("let me see\nCALL calculator(12345 + 67890)\nCALL calculator\nCALL x({})", tools)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "12345 + 67890"}), ("x", {})]
    assert bad == ["CALL calculator"]
    assert load_parser("auto", CHATML).name == "hermes" and load_parser("auto", "{{ m }}").name == "plain"
    renderer = ChatRenderer(tok, [CALC], HermesParser())
    check_parser(HermesParser(), [CALC], renderer.render_call)  # the template's own call reads back
    with pytest.raises(ParserError, match="would never fire"):
        check_parser(Llama3JsonParser(), [CALC], ChatRenderer(tok, [CALC], Llama3JsonParser()).render_call)
    with pytest.raises(ParserError, match="unknown tool-call parser 'qwen9'"):
        load_parser("qwen9", CHATML)


def test_the_plain_parser_describes_the_tools_in_the_system_message():
    from megarl.models.hf_io import default_model_path, load_tokenizer

    try:
        smol = load_tokenizer(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # SmolLM2's template renders role and content only: tools=... leaves no trace
    plain = smol.apply_chat_template(USER, tokenize=False)
    assert smol.apply_chat_template(USER, tools=[CALC.schema()], tokenize=False) == plain
    parser = load_parser("auto", smol.chat_template)
    renderer = ChatRenderer(smol, [CALC], parser)
    text = renderer.render(renderer.first_messages(USER))
    assert parser.name == "plain" and "CALL calculator(" in text and "You are a helpful AI assistant" not in text


def test_calculator_evaluates_arithmetic_only():
    assert evaluate("12345 + 67890") == 80235 and evaluate("(3 + 4) * 5 - 2 ** 3") == 27
    assert evaluate("7 / 2") == 3.5 and evaluate("1,234 * 2") == 2468 and evaluate("sqrt(16) + abs(-1)") == 5
    for bad in ("__import__('os').system('true')", "9 ** 9 ** 9", "1 / 0", "x + 1", "'a' * 3", "[1, 2]",
                "(lambda: 1)()", "10 ** 200"):
        with pytest.raises(CalculatorError):
            evaluate(bad)


def _routes(call: int, rows: int) -> torch.Tensor:
    """``[rows, 1, 1]`` int16 routes whose value names the call and the position: ``10 * call + position``."""
    return (10 * call + torch.arange(rows, dtype=torch.int16)).reshape(rows, 1, 1)


def test_samples_from_calls_extend_a_sample_while_prompts_extend_it():
    """Each token keeps the version of the call that sampled it (-1 on observations) and the routes of the call
    that first ran it: the prompt and a turn's sampled tokens from that call, the turn's last sampled token and
    the observations after it from the next call's prefill (what vLLM's prefix cache reuses)."""
    calls = [([1, 2], [3, 4], [-1.0, -2.0], 5, _routes(1, 3)), ([1, 2, 3, 4, 9], [5], [-3.0], 6, _routes(2, 5)),
             ([7, 8], [6], [-4.0], 6, _routes(3, 2))]
    first, second = samples_from_calls(calls)
    assert (first.prompt_ids, first.response_ids, first.mask) == ([1, 2], [3, 4, 9, 5], [1, 1, 0, 1])
    assert first.logprobs == [-1.0, -2.0, 0.0, -3.0]
    assert first.versions == [5, 5, -1, 6]
    assert first.routed_experts.flatten().tolist() == [10, 11, 12, 23, 24]  # every token but the last
    assert (second.prompt_ids, second.response_ids, second.mask) == ([7, 8], [6], [1])
    assert second.versions == [6] and second.routed_experts.flatten().tolist() == [30, 31]
    plain, = samples_from_calls([([1], [2], [-1.0], None, None)])
    assert plain.versions == [-1] and plain.routed_experts is None


def _policy_loss_grads(ids: torch.Tensor, labels: torch.Tensor, batch, noise: float = 0.0):
    """The actor's loss on a tiny transformers model (log-probs of ``labels``, response frame, masks of
    ``batch``; ``noise`` added to the entropy, old and reference log-probs off the mask) and its gradient w.r.t.
    the parameters and the response-frame log-probs."""
    from transformers import AutoModelForCausalLM

    from megarl.algos.losses import actor_loss
    from megarl.models.spec import ModelSpec
    from megarl.data.batch import to_response_frame

    torch.manual_seed(0)
    spec = ModelSpec("llama", vocab_size=300, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                     head_dim=8, ffn_hidden_size=64, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32)
    logits = model(input_ids=ids).logits
    token_logp = logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    logp = to_response_frame(token_logp, batch["prompt_lens"], batch["response_mask"].shape[1])
    logp.retain_grad()
    off = (1 - batch["response_mask"]) * noise
    old = batch["rollout_logprobs"] - 0.2 * batch["response_mask"] + off  # a ratio other than 1 on sampled tokens
    loss, metrics = actor_loss(logp, old, torch.ones_like(logp), batch["response_mask"], entropy=logp.exp() + off,
                               entropy_coeff=0.01, ref_logprob=old - 0.1 + off, kl_coef=0.1, kl_kind="k3",
                               global_tokens=float(batch["response_mask"].sum()))
    loss.backward()
    return (torch.cat([p.grad.flatten() for p in model.parameters()]), logp.grad,
            {k: v.item() for k, v in metrics.items()})


def test_the_policy_loss_sees_sampled_tokens_of_every_turn_and_observations_only_as_context(tok):
    from megarl.data.batch import build_batch

    out, _, _ = _run(tok, _calls_script(tok), tools=[CALC])
    (sample,) = out.episodes[0].samples
    batch = build_batch([sample.prompt_ids], [sample.response_ids], [torch.tensor(sample.logprobs)], [0],
                        pad_token_id=0, response_masks=[sample.mask])
    mask = batch["response_mask"][0]
    assert mask[:len(sample.mask)].tolist() == [float(m) for m in sample.mask]
    ids = batch["input_ids"]
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # position t predicts token t + 1
    grads, frame_grad, metrics = _policy_loss_grads(ids, labels, batch)
    sampled = mask.bool()
    assert (frame_grad[0][sampled] != 0).all()  # every sampled token of all three turns gets gradient
    assert (frame_grad[0][~sampled] == 0).all()  # no observation token does
    # other targets at the observation positions (the same context): the same gradient, loss and metrics
    k = batch["prompt_lens"][0] - 1
    positions = (k + torch.nonzero(~sampled[:len(sample.mask)]).flatten())
    other = labels.clone()
    other[0, positions] = (other[0, positions] + 7) % 300
    grads2, _, metrics2 = _policy_loss_grads(ids, other, batch, noise=5.0)  # and other entropy, KL inputs there
    assert torch.equal(grads, grads2) and metrics == metrics2 and metrics["entropy"] != 0


def test_an_environment_that_never_answers_ends_its_episode_only(tok):
    """Issue 48: an environment whose ``step`` (or ``reset``) never returns ended nothing but the run (at the
    watchdog's ``trainer.timeout_s``). Past ``env_timeout_s`` its episode ends with reward 0, counted in
    ``agent/env_timeouts``; the other episodes run to their end."""
    gate = threading.Event()

    class Hangs(ToolEnvironment):
        def reset(self, row, prompt):
            if prompt[0]["content"] == "c":
                gate.wait(60)
            return prompt

        def step(self, turn):
            if turn.text.startswith("hello"):
                gate.wait(60)
            return StepResult(reward=1.0, done=True)

    script = {"a": "hello", "b": "the answer", "c": "the answer"}
    try:
        out, _, _ = _run(tok, lambda p, t: _ids(tok, script[tok.decode(p).split("user\n")[1][0]]) + [tok.eos_token_id],
                         env=Hangs, prompts=[[{"role": "user", "content": k}] for k in "abc"],
                         settings=EpisodeSettings(max_turns=4, max_turn_tokens=400, env_timeout_s=0.5))
    finally:
        gate.set()
    hung, fine, hung_reset = out.episodes
    assert (hung.end, hung.reward, hung.turns) == ("env_timeout", 0.0, 1)
    assert (fine.end, fine.reward) == ("done", 1.0)
    assert (hung_reset.end, hung_reset.reward, hung_reset.turns) == ("env_timeout", 0.0, 0)
    m = out.metrics()
    assert m["agent/env_timeouts"] == 2 and m["agent/ended/env_timeout"] == pytest.approx(2 / 3)


class Again:
    """Answers every turn with a user message "again", never done."""

    def reset(self, row, prompt):
        return prompt

    def step(self, turn):
        return StepResult([{"role": "user", "content": "again"}])


def test_the_episode_budget_counts_sampled_and_observation_tokens_for_every_template():
    """Issue 48: ``max_episode_tokens`` is sampled plus observation tokens after the first prompt. A template that
    re-renders the history (dropping earlier turns' reasoning, where the episode is split) had the whole new
    prompt counted against the budget, then no observation tokens after the split. Given the same turns, every
    budget now ends the episode at the same turn for the append-only template and the re-rendering one, and
    the append-only episode's sampled and observation tokens are what the budget counts."""
    answer = "<think>the answer is</think>here"
    chatml, strip = bpe_tokenizer(CHATML), bpe_tokenizer(CHATML_STRIP)
    turn = _ids(chatml, answer) + [chatml.eos_token_id]
    assert turn == _ids(strip, answer) + [strip.eos_token_id]

    def episode(template, budget):
        tokenizer = chatml if template is CHATML else strip
        out, _, _ = _run(tokenizer, lambda p, t: turn, env=Again, template=template,
                         settings=EpisodeSettings(max_turns=6, max_turn_tokens=64, max_episode_tokens=budget))
        return out.episodes[0]

    full = episode(CHATML, 0)
    assert full.end == "max_turns" and full.splits == 0
    (sample,) = full.samples
    observation = (len(sample.response_ids) - 6 * len(turn)) // 5  # each turn's sampled ids, then its observation's
    assert sample.mask == ([1] * len(turn) + [0] * observation) * 5 + [1] * len(turn)
    assert episode(CHATML_STRIP, 0).splits == 4  # the re-rendering template splits after every turn but the first
    for budget in range(len(turn) + 1, 6 * (len(turn) + observation), 3):
        append_only, rerendered = episode(CHATML, budget), episode(CHATML_STRIP, budget)
        assert (append_only.end, append_only.turns) == (rerendered.end, rerendered.turns), budget
        # the turns that fit: each turn's sampled ids, and the observation before the next, within the budget
        fit = next(k for k in range(1, 7) if k == 6 or k * len(turn) + k * observation >= budget)
        assert append_only.turns == fit, (budget, append_only.turns, fit)
