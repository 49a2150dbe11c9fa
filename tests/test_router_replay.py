"""Router replay (``actor.moe.router_replay``, issue 32): the transformers engine records the experts of every token
it routes, and the actor's old-log-prob and update passes route those tokens to the same experts; the routing
agreement metric (engine vs trainer, per layer) with replay on and off. The same for the vLLM engine's routes,
converted from vLLM 0.24's ``routed_experts`` as the fake vLLM (:mod:`tests.fake_vllm.vllm`) returns them.

The trainer's routers are perturbed (noise on the router weights of the Megatron actor), so that without replay
they choose other experts than the engine for a good share of the tokens and the checks can fail. What the
trainer dispatched is read by a hook of the test's own on megatron's routers (their ``routing_map``), laid out
against the engine's routes here, independently of :class:`megarl.models.router_replay.RouteReplay`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_moe_model

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 3], [5, 6]]


def _engine_routes_reference(engine, samples, prompts):
    """Per sample ``[tokens - 1, layers, top_k]``: the top-k experts of the engine's own model run once, teacher
    forced, over the sample's whole sequence alone (``output_router_logits``), sorted."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([prompts[s.prompt_index] + list(s.token_ids)])
            logits = engine.model(input_ids=ids, output_router_logits=True).router_logits  # per layer [T, E]
            top = torch.stack([lg.topk(engine.spec.moe_top_k, dim=-1).indices for lg in logits], dim=1)
            out.append(top[:-1].sort(-1).values)
    return out


def _engine_batch(model_dir, engine_kind="hf"):
    """The samples of :data:`PROMPTS` of an engine of ``engine_kind`` ("hf"; "vllm": the fake vLLM, recording
    routes) and their batch (routes, old log-probs, advantages)."""
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.rollout.base import SamplingConfig, state_dict_writer
    from megarl.rollout.hf_engine import HFRolloutEngine
    from megarl.data.batch import build_batch

    hf = open_hf_checkpoint(model_dir)
    spec = hf.spec
    if engine_kind == "hf":
        engine = HFRolloutEngine(spec, max_batch_size=3)  # prompts of several lengths in batches: left padding
    else:
        from tests.test_rollout_vllm_tp import _fake_vllm

        _fake_vllm()
        from megarl.rollout.vllm_engine import VLLMRolloutEngine

        engine = VLLMRolloutEngine(spec, record_routes=True)
    engine.update_weights(state_dict_writer({n: hf.read(n) for n in hf.tensor_names}, engine.weight_layout([0]), 0))
    samples = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=6, seed=3)).samples
    batch = build_batch([PROMPTS[s.prompt_index] for s in samples], [s.token_ids for s in samples],
                        [s.logprobs for s in samples], [s.prompt_index for s in samples], pad_token_id=0,
                        routed_experts=[s.routed_experts for s in samples])
    batch["old_logprobs"] = torch.stack([torch.nn.functional.pad(s.logprobs, (0, batch["response_mask"].shape[1]
                                                                               - len(s.logprobs))) for s in samples])
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    return engine, samples, batch


def _perturbed_actor(spec, layout, model_dir, rc):
    """The actor of ``model_dir`` on ``layout`` with noise on every router's weights (the same at any layout:
    seeded by the global layer)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.workers.actor import PolicyWorker

    worker = PolicyWorker(spec, layout, "actor", model_dir, torch.float32, rc, trainable=True, temperature=1.0)
    with torch.no_grad():
        for m in worker.model.modules():
            if isinstance(m, TopKRouter):
                g = torch.Generator().manual_seed(m.layer_number)
                m.weight.add_(0.5 * m.weight.std() * torch.randn(m.weight.shape, generator=g))
    return worker


def record_dispatch(model: torch.nn.Module) -> list:
    """Hooks on every megatron router of ``model``; the list they fill: ``(layer, routing_map [s * b, experts]
    bool)`` of every router forward, in order."""
    from megatron.core.transformer.moe.router import TopKRouter

    used = []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(lambda mod, args, o: used.append((mod.layer_number - 1, o[1].bool())))
    return used


def dispatch_agreement(used: list, routes: torch.Tensor, mbs: int) -> list[float]:
    """Per layer, the share of the routed tokens whose dispatched experts (``used`` of :func:`record_dispatch`,
    over every pass since the last call: an update may run a counting pass first, emptied here) are the
    engine's ``routes [B, S, layers, top_k]``, for padded micro-batches of ``mbs`` rows in order."""
    layers = routes.shape[2]
    agree, total = [0] * layers, [0] * layers
    for k, (layer, routing_map) in enumerate(used):
        lo = (k // layers) % (len(routes) // mbs) * mbs
        rows = routes[lo:lo + mbs].to(routing_map.device)  # [b, S, L, K]
        engine_routes = rows.transpose(0, 1).reshape(-1, *rows.shape[2:])[:, layer].long()  # megatron's [s, b]
        valid = engine_routes[:, 0] >= 0
        engine_map = torch.zeros_like(routing_map).scatter_(1, engine_routes.clamp(min=0), True)
        agree[layer] += int(((routing_map == engine_map).all(1) & valid).sum())
        total[layer] += int(valid.sum())
    used.clear()
    return [a / n for a, n in zip(agree, total)]


def _replay_world(rank, world, model_dir):
    """The engine's routes against an independent run of its model; then, for an actor with replay off and one
    with replay on, per layer the agreement of what its routers dispatched in the old-log-prob and update
    passes, its metric, and the log-probs of packed micro-batches against padded ones; the (fake) vLLM engine's
    routes against an independent run of its model (bf16 weights), and the metric of an old-log-prob pass of
    its batch."""
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, MoEConfig
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.models.router_replay import ROUTES
    from megarl.rollout.base import state_dict_writer
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    engine, samples, batch = _engine_batch(model_dir)
    spec = engine.spec
    reference = _engine_routes_reference(engine, samples, PROMPTS)
    out = {"recorded_vs_reference": [bool((s.routed_experts.long().sort(-1).values == r).all())
                                     for s, r in zip(samples, reference)],
           "lengths": [(len(PROMPTS[s.prompt_index]) + len(s.token_ids) - 1, s.routed_experts.shape[0])
                       for s in samples]}
    _, vllm_samples, vllm_batch = _engine_batch(model_dir, "vllm")
    hf = open_hf_checkpoint(model_dir)
    engine.update_weights(state_dict_writer({n: hf.read(n).bfloat16() for n in hf.tensor_names},
                                            engine.weight_layout([0]), 0))  # the weights vLLM holds
    out["vllm_vs_reference"] = [(s.routed_experts.dtype, s.routed_experts.shape[0],
                                 len(PROMPTS[s.prompt_index]) + len(s.token_ids) - 1,
                                 bool((s.routed_experts.long().sort(-1).values == r).all()))
                                for s, r in zip(vllm_samples, _engine_routes_reference(engine, vllm_samples, PROMPTS))]
    mbs = 2

    def agreement_of_pass():
        return dispatch_agreement(used, batch[ROUTES], mbs)

    mask = batch["response_mask"].bool()
    for replay in (False, True):
        rc = ActorConfig(micro_batch_size=mbs, logprob_micro_batch_size=mbs, ppo_mini_batch_size=len(batch),
                         moe=MoEConfig(router_replay=replay))
        worker = _perturbed_actor(spec, layout, model_dir, rc)
        used = record_dispatch(worker.model)
        padded = worker.compute_logprobs(batch)["logprobs"]
        old_pass = agreement_of_pass()
        metrics = worker.routing_agreement()
        worker.compute_logprobs(vllm_batch)
        vllm_metrics = worker.routing_agreement()
        other = {}  # micro-batches by token count: rows cut to the longest, or packed back to back
        for name, packing in (("trimmed", False), ("packed", True)):
            worker.rc = dataclasses.replace(rc, max_tokens_per_micro_batch=24, sequence_packing=packing)
            other[name] = float((worker.compute_logprobs(batch)["logprobs"] - padded)[mask].abs().max())
        used.clear()
        worker.rc = rc
        worker.update(batch, AlgorithmConfig(kl=KLConfig(coef=0.0)), seed=0)
        out[replay] = {"old_pass": old_pass, "update_pass": agreement_of_pass(), "metrics": metrics,
                       "vs_padded": other, "vllm": vllm_metrics}
    return out


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return str(make_tiny_moe_model(tmp_path_factory.mktemp("replay") / "model"))


def test_router_replay_routes_the_trainer_to_the_engine_experts(moe_model):
    res = run_world(_replay_world, 1, moe_model)[0]
    # the engine recorded every token but the last of each sample, the experts its model routes them to alone
    assert all(want == got for want, got in res["lengths"]), res["lengths"]
    assert all(res["recorded_vs_reference"]), res["recorded_vs_reference"]
    on, off = res[True], res[False]
    # the metric: without replay the old-log-prob pass's agreement; with replay the routers' own choice beside
    # the replayed routes (issue 48), in layer 0 (whose input replay does not change) the same as without
    layers = [off["metrics"][f"moe/routing_agreement/layer_{i}"] for i in range(len(off["old_pass"]))]
    assert layers == pytest.approx(off["old_pass"], abs=1e-12)
    for r in (on, off):
        layers = [r["metrics"][f"moe/routing_agreement/layer_{i}"] for i in range(len(r["old_pass"]))]
        assert r["metrics"]["moe/routing_agreement"] == pytest.approx(sum(layers) / len(layers))
    assert on["metrics"]["moe/routing_agreement/layer_0"] == pytest.approx(off["old_pass"][0], abs=1e-12), on
    # with replay every token the engine routed goes to its experts, in the old-log-prob pass and in the update
    assert on["old_pass"] == [1.0, 1.0] and on["update_pass"] == [1.0, 1.0], on
    # in micro-batches by token count, cut or packed, each token still gets its own routes: the padded log-probs
    assert max(on["vs_padded"].values()) < 1e-5, on["vs_padded"]
    # without, the perturbed routers choose otherwise for a good share of the tokens, and the metric says so
    assert max(off["old_pass"] + off["update_pass"]) < 0.9, off
    # vLLM's routes (its format converted): int16, every token but the last, the experts of its model
    assert all(v[:2] == (torch.int16, v[2]) and v[3] for v in res["vllm_vs_reference"]), res["vllm_vs_reference"]
    assert on["vllm"]["moe/routing_agreement/layer_0"] == pytest.approx(
        off["vllm"]["moe/routing_agreement/layer_0"], abs=1e-12), (on["vllm"], off["vllm"])
    assert off["vllm"]["moe/routing_agreement"] < 0.9, off["vllm"]


def test_router_replay_refuses_what_it_cannot_replay():
    from megarl.config import ConfigError, load_config
    from megarl.models.spec import ModelSpec
    from megarl.trainer.preflight import validate_for_model

    assert load_config(None, ["rollout.engine=vllm", "actor.moe.router_replay=true"]).actor.moe.router_replay
    with pytest.raises(ConfigError, match=r"rollout\.model_runner: must be v1 or null with actor\.moe\.router_replay"):
        load_config(None, ["rollout.engine=vllm", "rollout.model_runner=v2", "actor.moe.router_replay=true"])
    with pytest.raises(ConfigError, match=r"actor\.moe\.router_replay: with recompute and parallel\.pp > 1"):
        load_config(None, ["actor.moe.router_replay=true", "actor.recompute=true", "actor.parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"critic\.moe\.router_replay"):
        load_config(None, ["critic.moe.router_replay=true"])
    assert not load_config(None, []).actor.moe.router_replay  # off by default
    dense = ModelSpec("llama", 64, 32, 1, 4, 2, 16, 64, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"actor\.moe\.router_replay: a llama model has no experts"):
        validate_for_model(load_config(None, ["actor.moe.router_replay=true"]), dense)


def _train_on_fake_vllm(rank, world, overrides):
    from tests.rl_tasks import train_on_rank
    from tests.test_rollout_vllm_tp import _fake_vllm

    _fake_vllm()
    return train_on_rank(rank, world, overrides)


def test_router_replay_in_a_training_run(tmp_path):
    """``megarl train`` with an MoE actor, ``actor.moe.router_replay=true`` and ``rollout.engine=vllm`` (the fake
    vLLM; the transformers engine's samples carry their routes the same way): the config starts the engine
    recording routes, they travel from its samples through the batch to the actor, and every step reports the
    routing agreement: the actor's routers' own choice against the engine's routes, nearly every token (the fake
    vLLM holds the weights in bf16, the actor in fp32: a near-tie may flip; issue 48: it read 1 by
    construction)."""
    from tests.rl_tasks import task_overrides, write_prompts

    model = make_tiny_moe_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 16)
    history = run_world(_train_on_fake_vllm, 1, task_overrides(model, data, tmp_path / "runs", "replay") + [
        "trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=2", "rollout.n=4", "rollout.engine=vllm",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "actor.moe.router_replay=true"])[0]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert all(0.9 < h[f"moe/routing_agreement{k}"] <= 1.0 for k in ("", "/layer_0", "/layer_1")), h


LAYOUTS = [dict(dp=2), dict(tp=2, sequence_parallel=True), dict(pp=2), dict(dp=2, ep=2)]  # EP: all-to-all dispatch


def _layouts_world(rank, world, model_dir):
    """Per layout of :data:`LAYOUTS` (2 ranks): the old log-probs with replay, and the routing agreement with
    replay and without."""
    from megarl.config import ActorConfig, MoEConfig, ParallelConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    engine, _, batch = _engine_batch(model_dir)  # the same samples on both ranks
    spec = engine.spec
    out = {}
    for kw in LAYOUTS:
        sp = kw.pop("sequence_parallel", False)
        layout = ParallelLayout(**kw)
        initialize_model_parallel(layout)
        rc = ActorConfig(parallel=ParallelConfig(**kw, sequence_parallel=sp), micro_batch_size=2,
                         logprob_micro_batch_size=2, ppo_mini_batch_size=len(batch), moe=MoEConfig(router_replay=True))
        worker = _perturbed_actor(spec, layout, model_dir, rc)
        logprobs = worker.compute_logprobs(batch)["logprobs"]
        with_replay = worker.routing_agreement()
        worker.routes.replay = False  # the same actor routing for itself
        worker.compute_logprobs(batch)
        out[str(kw) + ("sp" if sp else "")] = (logprobs[batch["response_mask"].bool()], with_replay,
                                              worker.routing_agreement())
    return out


def test_router_replay_at_every_layout(moe_model):
    """TP with sequence parallelism, PP and EP (2 ranks): each rank's routers get their own tokens' routes, so
    the replayed log-probs are those of DP=2 (whose micro-batches are the single rank's, checked above), and
    the agreement without replay is the same share at every layout."""
    res = run_world(_layouts_world, 2, moe_model)[0]
    base_logprobs, _, base_off = res["{'dp': 2}"]
    assert base_off["moe/routing_agreement"] < 0.9, base_off
    for name, (logprobs, with_replay, without) in res.items():
        assert (logprobs - base_logprobs).abs().max() < 1e-4, name
        assert without == pytest.approx(base_off, abs=0.035), name  # a near-tie may flip between layouts
        # the routers' own choice beside the replayed routes: layer 0's input is the same as without replay
        assert with_replay["moe/routing_agreement/layer_0"] == pytest.approx(
            without["moe/routing_agreement/layer_0"], abs=1e-12), name


def _shifted_world(rank, world, model_dir):
    """The routing agreement of an actor with replay whose weights are the engine's: on the engine's routes, and
    on the same routes shifted one token later (each token given its predecessor's experts)."""
    from megarl.config import ActorConfig, MoEConfig
    from megarl.models.router_replay import NO_ROUTE, ROUTES
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    engine, _, batch = _engine_batch(model_dir)
    rc = ActorConfig(micro_batch_size=2, logprob_micro_batch_size=2, ppo_mini_batch_size=len(batch),
                     moe=MoEConfig(router_replay=True))
    worker = PolicyWorker(engine.spec, layout, "actor", model_dir, torch.float32, rc, trainable=True,
                          temperature=1.0)
    worker.compute_logprobs(batch)
    aligned = worker.routing_agreement()
    routes = batch[ROUTES]
    shifted = torch.full_like(routes, NO_ROUTE)
    shifted[:, 1:] = routes[:, :-1]
    shifted[routes[..., 0, 0] == NO_ROUTE] = NO_ROUTE  # the tokens the engine routed, as before
    batch[ROUTES] = shifted
    worker.compute_logprobs(batch)
    return aligned, worker.routing_agreement()


def test_the_routing_agreement_shows_replayed_routes_shifted_by_a_token(moe_model):
    """Issue 48: with replay the metric compared the experts dispatched with the replayed ones, 1 by
    construction: routes shifted by one token against their tokens read 1.0 too. It compares the routers' own
    choice with the engine's routes position by position now: aligned, the actor (the engine's weights) agrees
    on every token; shifted, on few."""
    aligned, shifted = run_world(_shifted_world, 1, moe_model)[0]
    assert aligned["moe/routing_agreement"] == 1.0, aligned
    assert shifted["moe/routing_agreement"] < 0.7, shifted
