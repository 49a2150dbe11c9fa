"""Multi-turn episodes composed with the rest of megarl (issue 44), on the CPU with the tiny models and the
two-turn :class:`tests.rl_tasks.SecretWord` task: DAPO's dynamic sampling over groups of episodes, a LoRA actor,
router replay of every token an episode's turns ran (sampled, and observations prefilled by the next turn) and
one-step-off async RL on a rollout pool of its own, with every trained token's policy version checked against the
staleness bound (:mod:`megarl.data.staleness`)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from tests.distributed import run_world
from tests.rl_tasks import (SPLIT_2, make_tiny_model, make_tiny_moe_model, multi_turn_overrides, train_on_rank,
                            write_prompts)

SMALL = ["trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=8", "actor.optim.lr=1e-2", "trainer.log_samples=64"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("mt_compose")
    return root, make_tiny_model(root / "model", embedding_scale=3), write_prompts(root / "prompts.jsonl", 64)


def _samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ the staleness bound
def test_the_bound_takes_every_token_older_than_it_out_of_the_loss():
    """Stamps of versions 3..6 (and observations, -1) trained at step 7 (weights of version 6) with bound 1:
    versions 3 and 4 (staleness 3 and 2) leave the loss mask, 5 and 6 stay; the figures are the sampled tokens'."""
    from megarl.data.batch import build_batch
    from megarl.data.staleness import bound_token_staleness, stamp_token_versions, trained_versions

    batch = build_batch([[1, 2]] * 3, [[3, 4, 5, 6], [7, 8], [9]], [torch.zeros(4), torch.zeros(2), torch.zeros(1)],
                        [0, 0, 1], pad_token_id=0, response_masks=[[1, 1, 0, 1], [1, 1], [1]])
    stamp_token_versions(batch, [[3, 4, -1, 6], [5, 5], []], default=6)
    assert batch["token_version"][:, :4].tolist() == [[3, 4, -1, 6], [5, 5, -1, -1], [6, -1, -1, -1]]
    batch["loss_mask"] = batch["response_mask"].float()
    metrics = bound_token_staleness(batch, step=7, bound=1)
    assert batch["loss_mask"][:, :4].tolist() == [[0, 0, 0, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
    stale = torch.tensor([3, 2, 0, 1, 1, 0], dtype=torch.float64)
    assert metrics == {"rollout/token_staleness_min": 0.0, "rollout/token_staleness_max": 3.0,
                       "rollout/token_staleness_mean": pytest.approx(stale.mean().item()),
                       "rollout/tokens_past_bound": 2.0}
    assert [trained_versions(batch, i) for i in range(3)] == [{"6": 1}, {"5": 2}, {"6": 1}]


def test_in_flight_updates_send_a_steps_weights_before_the_hand_over_and_are_refused_without_episodes():
    from megarl.config import ConfigError, load_config
    from megarl.trainer.loop import in_flight_order
    from megarl.trainer.pipeline import schedule

    (_, first), (_, second), (_, last) = schedule(0, 3, 1, lambda s: False)
    assert [tuple(e) for e in in_flight_order(first, 1)] == [
        ("reshard", 0), ("generate", 1), ("batch", 1), ("generate", 2), ("train", 1), ("reshard", 1), ("batch", 2)]
    assert in_flight_order(second, 2) == second and in_flight_order(last, 3) == last  # no weights sent: as they were
    for extra in (["trainer.mode=async"], ["rollout.multi_turn.enabled=true"]):
        with pytest.raises(ConfigError, match=r"trainer\.in_flight_updates: changes the weights between the turns"):
            load_config(None, ["trainer.in_flight_updates=true"] + extra)


# ------------------------------------------------------------------------------ DAPO
def test_dynamic_sampling_keeps_the_groups_of_episodes_whose_rewards_differ(task):
    root, model, data = task
    m = run_world(train_on_rank, 1, multi_turn_overrides(model, data, root / "runs", "dapo") + SMALL + [
        "trainer.steps=1", "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_extra_rounds=3",
        "algorithm.loss_agg_mode=token-mean"])[0][0]
    rounds, kept, tied = (m[f"dynamic_sampling/{k}"] for k in ("rounds", "groups_kept", "groups_tied_kept"))
    assert m["dynamic_sampling/groups_generated"] == 4 * rounds  # every round drew a whole batch of prompts
    assert m["dynamic_sampling/groups_short"] == 4 - kept
    assert kept + tied in (2, 4) and (kept + tied) % 2 == 0  # whole mini-batches: units of 2 groups of 4 episodes
    # the trained groups, read back from the samples: those with signal are exactly the ones kept
    by_prompt = defaultdict(list)
    for s in _samples(root / "runs" / "dapo"):
        by_prompt[s["prompt"]].append(s["score"])
    assert len(by_prompt) == kept + tied and all(len(v) == 4 for v in by_prompt.values()), by_prompt
    assert sum(len(set(v)) > 1 for v in by_prompt.values()) == kept, by_prompt
    # one row per episode, its two sampled tokens trained (the observation between them is context): the
    # token-mean loss is normalised by sampled tokens alone
    assert m["agent/rows"] == 4 * (kept + tied) and m["response/length_mean"] == 2.0
    assert m["agent/observation_tokens"] > 0


# ------------------------------------------------------------------------------ LoRA
def _lora_run(rank, world, overrides):
    """Train; returns the metrics and the names of the actor's parameters the run changed and left alone."""
    from megarl.config import load_config
    from megarl.trainer.builders import seed_all
    from megarl.trainer.loop import fit
    from megarl.trainer.metrics import read_metrics
    from megarl.trainer.trainer import Trainer

    cfg = load_config(None, overrides)
    seed_all(cfg.run.seed)
    trainer = Trainer(cfg)
    before = {n: t.clone() for n, t in trainer.actor.source_tensors().items()}
    fit(trainer)
    after = trainer.actor.source_tensors()
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    return read_metrics(cfg.run.run_dir / "metrics.jsonl"), changed, sorted(set(before) - set(changed))


def test_a_lora_actor_trains_its_adapters_alone_on_episodes(task):
    root, model, data = task
    history, changed, kept = run_world(_lora_run, 1, multi_turn_overrides(model, data, root / "runs", "lora") + SMALL
                                       + ["actor.lora.rank=4", "actor.lora.alpha=8"])[0]
    assert [h["step"] for h in history] == [1, 2] and all("actor/kl" in h for h in history)  # the base: reference
    assert changed and all(".lora_" in n for n in changed), changed  # adapters only
    assert any(".lora_b" in n for n in changed) and not any(".lora_" in n for n in kept), kept
    samples = _samples(root / "runs" / "lora")
    assert [s["adapter_version"] for s in samples] == [s["policy_version"] for s in samples] == \
        [s["step"] - 1 for s in samples]


# ------------------------------------------------------------------------------ router replay
def test_router_replay_routes_every_token_of_every_turn_as_the_engine_ran_it(tmp_path):
    """The engine's episodes on the tiny MoE model: each row of the batch has a route at every position but its
    last token (the prompt, both turns' sampled tokens, and the observation and the first turn's end that the
    second turn's prefill ran), equal to the engine's model's own top-k over the whole sequence, teacher forced;
    then a training run replays them."""
    from megarl.agents.episode import ChatRenderer
    from megarl.agents.parsers import load_parser
    from megarl.agents.rollout import EpisodeSettings, run_episodes
    from megarl.data.loader import PromptBatch
    from megarl.models.hf_io import load_tokenizer, open_hf_checkpoint
    from megarl.models.router_replay import NO_ROUTE
    from megarl.rollout.base import SamplingConfig, state_dict_writer
    from megarl.rollout.hf_engine import HFRolloutEngine
    from megarl.trainer.episodes import episode_batch
    from tests.rl_tasks import SecretWord

    model = make_tiny_moe_model(tmp_path / "model")
    hf = open_hf_checkpoint(model)
    engine = HFRolloutEngine(hf.spec, max_batch_size=3)
    engine.update_weights(state_dict_writer({n: hf.read(n) for n in hf.tensor_names}, engine.weight_layout([0]), 0))
    tok = load_tokenizer(str(model))
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    rows = [{"question": q} for q in ("a b c", "d e", "f g h i")]
    out = run_episodes(engine, renderer, SecretWord, rows, [[{"role": "user", "content": r["question"]}] for r in rows],
                       SamplingConfig(n=2, max_new_tokens=3, seed=5), EpisodeSettings(max_turns=2, max_turn_tokens=3))
    prompts = PromptBatch([[]] * 3, [0, 1, 2], [None] * 3, [r["question"] for r in rows], rows)
    batch = episode_batch(prompts, out, tok, pad_token_id=0, seq_multiple=1, multiple=1)
    assert out.metrics()["agent/observation_tokens"] > 0 and out.metrics()["agent/turns_mean"] == 2
    routes, lens = batch["routed_experts"], batch["prompt_lens"] + batch["response_lens"]
    for i in range(len(batch)):
        n = int(lens[i])
        ids = batch["input_ids"][i, :n]
        assert (routes[i, :n - 1] != NO_ROUTE).all() and (routes[i, n - 1:] == NO_ROUTE).all(), i
        with torch.no_grad():
            logits = engine.model(input_ids=ids[None], output_router_logits=True).router_logits
        want = torch.stack([lg.topk(hf.spec.moe_top_k, dim=-1).indices for lg in logits], dim=1)[:-1]
        assert torch.equal(routes[i, :n - 1].sort(-1).values.long(), want.sort(-1).values), i

    data = write_prompts(tmp_path / "prompts.jsonl", 16)
    history = run_world(train_on_rank, 1, multi_turn_overrides(model, data, tmp_path / "runs", "r3") + SMALL + [
        "trainer.steps=1", "actor.moe.router_replay=true"])[0]
    assert [h["step"] for h in history] == [1]
    for h in history:  # the actor's routers agree with the replayed routes of the engine (fp32 both)
        assert all(0.9 < h[f"moe/routing_agreement{k}"] <= 1.0 for k in ("", "/layer_0", "/layer_1")), h


def test_a_vllm_request_carries_its_version_and_the_routes_of_its_prompt_and_sampled_tokens():
    """vLLM's request path (an episode's turns): a finished ``RequestOutput``'s routes (``[prompt + sampled - 1,
    layers, top_k]`` uint8, as vLLM 0.24 returns them) become the completion's int16 routes, with its version."""
    from types import SimpleNamespace

    import numpy as np

    from megarl.models.spec import ModelSpec
    from megarl.rollout.vllm_engine import request_output_to_completion

    spec = ModelSpec("qwen3_moe", vocab_size=16, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_hidden_size=128, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32)
    routes = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 8
    sampled = [5, 6, 1]
    out = SimpleNamespace(request_id="r", prompt_token_ids=[3, 4, 9, 2], num_cached_tokens=2, outputs=[
        SimpleNamespace(token_ids=sampled, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in sampled],
                        finish_reason="stop", routed_experts=routes)])
    done = request_output_to_completion(out, 3, spec)
    assert done.policy_version == 3 and done.cached_tokens == 2 and done.token_ids == (5, 6, 1)
    assert done.routed_experts.dtype == torch.int16 and done.routed_experts.tolist() == routes.tolist()
    assert request_output_to_completion(out, 3).routed_experts is None  # an engine not recording routes


# ------------------------------------------------------------------------------ async on a pool of its own
def test_async_episodes_on_a_rollout_pool_train_no_token_older_than_the_bound(task):
    """Split pools (actor on rank 0, rollout on rank 1), one step off, weights updated in flight: every trained
    token's stamp is the version its batch started with or, for the batch generated while step 1 trained (step
    1's weights reached the engine between turns), the one after; none is older than k = 1, and the step's token
    staleness says so. (Where in that batch the new weights took effect depends on timing:
    tests/test_agents.py checks an update between two turns.)"""
    from megarl.trainer.pipeline import generating_versions, schedule

    root, model, data = task
    history = run_world(train_on_rank, 2, multi_turn_overrides(model, data, root / "runs", "async") + SMALL + SPLIT_2
                        + ["trainer.steps=3", "trainer.mode=async", "trainer.max_staleness=1",
                           "trainer.in_flight_updates=true", "algorithm.rollout_correction.preset=token_tis"])[0]
    assert [h["rollout/staleness"] for h in history] == [0, 1, 1]  # by the version each batch started with
    started = generating_versions(schedule(0, 3, 1, lambda s: False))
    assert started == {1: 0, 2: 0, 3: 1}
    in_flight = {1: {0}, 2: {0, 1}, 3: {1}}  # batch 2 was generated while step 1 trained and sent its weights
    for h in history:
        assert h["rollout/tokens_past_bound"] == 0 and h["agent/turns_mean"] == 2
        assert {h["step"] - 1 - h[f"rollout/token_staleness_{m}"] for m in ("min", "max")} <= in_flight[h["step"]]
    samples = _samples(root / "runs" / "async")
    assert len(samples) == 3 * 16
    for s in samples:
        versions = {int(v): c for v, c in s["token_versions"].items()}
        assert sum(versions.values()) == 2 and set(versions) <= in_flight[s["step"]], s  # both turns, stamped
        assert all(0 <= s["step"] - 1 - v <= 1 for v in versions), s
        assert s["policy_version"] == min(versions), s
