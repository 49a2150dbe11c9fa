"""vLLM rollouts with TP > 1 inside the training world, on CPU: the data flow with a fake vLLM module
(:mod:`tests.fake_vllm.vllm`) in a gloo world of 4 ranks.

For Megatron meshes resharded into vLLM engines of another TP (larger and smaller), every rank's engine shard
must equal the one cut from the HF weights by the independent reference of :mod:`tests.test_reshard_exact`,
prompts must be split over rollout data parallelism (one share per engine, the same share on every rank of
an engine) and every rank must get every sample back, equal to what one engine holding the right weights
returns. The trainer runs one GRPO step with rollout TP=2 over an actor on PP=2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_world
from tests.test_reshard_exact import MODELS, hf_weights, megatron_coords, ref_megatron, ref_vllm

FAKE = str(Path(__file__).parent / "fake_vllm")
WORLD = 4
# model, Megatron (tp, pp), vLLM tp: rollout TP above and below the training TP, KV heads replicated (gqa_tied
# at TP=4 holds 2 KV heads), tied and untied embeddings, vocab padding (157 and 131 are padded on both sides)
CASES = [("gqa_untied_bias", (1, 2), 2), ("gqa_untied_bias", (2, 1), 1), ("gqa_tied", (2, 2), 4),
         ("mha_tied", (4, 1), 2)]
PROMPTS = [[3, 5, 7], [11], [2, 4, 6, 8], [9, 9], [1, 2], [13, 1, 4]]  # 6 prompts: shares of 3, 2 or 1 and 2
SAMPLING = dict(n=2, temperature=1.0, max_new_tokens=5, seed=11, stop_token_ids=(0,))


def _fake_vllm():
    if FAKE not in sys.path:
        sys.path.insert(0, FAKE)
    import vllm

    vllm.install()
    return vllm


def _spec(model: str):
    from megarl.models.spec import ModelSpec

    fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
    return ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied,
                     max_position_embeddings=64)


def _engines(rank: int, world: int, task: tuple) -> dict:
    _fake_vllm()
    from megarl.parallel.mesh import ParallelLayout
    from megarl.reshard.executor import execute_plan
    from megarl.models.layout_megatron import megatron_layout
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.data_parallel import generate_data_parallel, rollout_dp_group
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    out = {}
    for model, (tp, pp), rollout_tp in CASES:
        spec, w = _spec(model), hf_weights(model)
        mesh = ParallelLayout(tp, pp, world // (tp * pp))
        engine = VLLMRolloutEngine(spec, tp=rollout_tp)
        plan = plan_reshard(megatron_layout(spec, mesh), engine.weight_layout(range(world)), ranks_per_node=2)
        src = ref_megatron(model, w, tp, pp, *megatron_coords(rank, tp, mesh.dp))
        engine.update_weights(lambda dst: execute_plan(plan, src, dst, bucket_bytes=4096, direct_min_bytes=64))
        want = ref_vllm(model, w, rollout_tp, rank % rollout_tp)
        wrong = [n for n, p in engine._params.items() if not torch.equal(p, want[n].to(p.dtype))]
        result = generate_data_parallel(engine, PROMPTS, SamplingConfig(**SAMPLING),
                                        group=rollout_dp_group(rollout_tp))
        out[(model, tp, pp, rollout_tp)] = dict(
            wrong_shards=wrong, engine_ranks=engine.llm.ranks, generated=engine.llm.generated,
            samples=[(s.prompt_index, s.sample_index, s.token_ids, s.logprobs.tolist(), s.finish_reason)
                     for s in result.samples])
    out["fp8"] = _fp8_engines(rank, world)
    # the check can fail: ranks of one TP engine splitting the prompts over the world disagree
    try:
        generate_data_parallel(engine, PROMPTS, SamplingConfig(**SAMPLING), group=None)
        out["split_over_world"] = "no error"
    except RuntimeError as e:
        out["split_over_world"] = str(e)
    out["trainer"] = _trainer_step(rank, *task)
    return out


def _fp8_engines(rank: int, world: int) -> dict:
    """Block-FP8 engines of TP=2 with every vLLM knob of VLLMSettings set: the reshard from Megatron TP=2 x DP=2
    and the HF state dict's writer (each quantising on its own) give the same E4M3 bytes and scales, those of
    quantising the HF tensors then slicing (tests.test_reshard_fp8), and the same samples."""
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.spec import ModelSpec
    from megarl.parallel.mesh import ParallelLayout
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig, state_dict_writer
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings
    from tests.test_reshard_fp8 import MODELS as FP8_MODELS, _hf, ref_vllm_fp8

    fam, vocab, h, layers, heads, kv, hd, ffn, tied = FP8_MODELS["aligned"]
    spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied, max_position_embeddings=64)
    w = _hf("aligned", torch.bfloat16)
    settings = VLLMSettings(quantization="fp8", model_runner="v2", async_scheduling=True, max_num_seqs=8,
                            max_num_batched_tokens=64, cudagraph_capture_sizes=(1, 8), max_cudagraph_capture_size=8,
                            request_seeds=False)
    by_reshard = VLLMRolloutEngine(spec, tp=2, settings=settings, enforce_eager=False)
    mesh = ParallelLayout(2, 1, world // 2)
    plan = plan_reshard(megatron_layout(spec, mesh), by_reshard.weight_layout(range(world)))
    src = ref_megatron(FP8_MODELS["aligned"], w, 2, 1, rank % 2, 0)
    by_reshard.update_weights(lambda dst: execute_plan(plan, src, dst, bucket_bytes=20_000))
    by_writer = VLLMRolloutEngine(spec, tp=2, settings=settings, enforce_eager=False)
    by_writer.update_weights(state_dict_writer(w, by_writer.weight_layout(range(world)), rank))
    want = ref_vllm_fp8("aligned", w, 2, rank % 2)

    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    sampling = SamplingConfig(**SAMPLING)
    return dict(
        wrong_reshard=[n for n, t in by_reshard._params.items() if not torch.equal(raw(t), want[n])],
        wrong_writer=[n for n, t in by_writer._params.items() if not torch.equal(raw(t), want[n])],
        dtypes=sorted({str(t.dtype) for t in by_reshard._params.values()}),
        kwargs=by_reshard.llm.kwargs,
        same_samples=[s.token_ids for s in by_reshard.generate(PROMPTS, sampling).samples] ==
        [s.token_ids for s in by_writer.generate(PROMPTS, sampling).samples])


def _trainer_step(rank: int, model_dir: Path, data: Path, runs: Path) -> dict:
    """One GRPO step of the trainer with rollout TP=2 over an actor on PP=2 x DP=2 (fp32 actor, bf16 engine)."""
    from megarl.config import load_config
    from megarl.trainer.trainer import Trainer
    from tests.rl_tasks import task_overrides

    cfg = load_config(None, task_overrides(model_dir, data, runs, "vllm-tp2") + [
        "rollout.engine=vllm", "rollout.tp=2", "actor.parallel.pp=2", "data.prompts_per_step=6", "rollout.n=2",
        "actor.ppo_mini_batch_size=12", "actor.micro_batch_size=2", "trainer.steps=1", "data.shuffle=false",
        "algorithm.kl.coef=0"])
    trainer = Trainer(cfg)
    prompts = next(iter(trainer.loader))
    metrics = trainer.step(prompts)
    return dict(metrics=metrics, prompts=[list(p) for p in prompts.input_ids], generated=trainer.engine.llm.generated)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tests.rl_tasks import make_tiny_model, write_prompts

    root = tmp_path_factory.mktemp("vllm_tp")
    task = (make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 12), root / "runs")
    return run_world(_engines, WORLD, task, timeout_s=600)


def _expected(model: str) -> list:
    """What one engine with the reference weights (in bf16, vLLM's dtype) returns for all prompts (the fake's
    functions, loaded without putting the fake on this process's path: spawned GPU tests inherit it)."""
    import importlib.util

    source = importlib.util.spec_from_file_location("fake_vllm", Path(FAKE) / "vllm" / "__init__.py")
    vllm = sys.modules["fake_vllm"] = importlib.util.module_from_spec(source)  # dataclasses look it up there
    source.loader.exec_module(vllm)
    from megarl.models.layout import canonical_shapes
    from megarl.rollout.base import SamplingConfig, sample_rows, sample_seed
    from megarl.rollout.vllm_engine import request_params

    spec, w = _spec(model), hf_weights(model)
    weights = vllm.fingerprint({n: w[n].to(torch.bfloat16) for n in canonical_shapes(spec)})
    sampling = SamplingConfig(**SAMPLING)
    stop = sorted(set(spec.eos_token_ids) | set(sampling.stop_token_ids))
    out = []
    for k, j in sample_rows(len(PROMPTS), sampling.n):
        params = vllm.SamplingParams(**request_params(PROMPTS[k], sampling, context=64, stop_token_ids=stop,
                                                      seed=sample_seed(sampling.seed, 0, k, j)))
        c = vllm.fake_completion(weights, PROMPTS[k], params, spec.vocab_size)
        out.append((k, j, tuple(c.token_ids), [p[t].logprob for p, t in zip(c.logprobs, c.token_ids)],
                    c.finish_reason))
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-megatron-tp{t}pp{p}-vllm-tp{r}" for m, (t, p), r in CASES])
def test_every_rank_holds_its_vllm_shard_and_gets_every_sample(engines, case):
    model, (tp, pp), rollout_tp = case
    per_rank = [r[(model, tp, pp, rollout_tp)] for r in engines]
    for rank, r in enumerate(per_rank):
        assert not r["wrong_shards"], (rank, r["wrong_shards"])
        assert r["engine_ranks"] == list(range(rank - rank % rollout_tp, rank - rank % rollout_tp + rollout_tp))
    expected = _expected(model)
    for rank, r in enumerate(per_rank):
        got = [(k, j, tuple(t), lp, f) for k, j, t, lp, f in r["samples"]]
        assert [g[:3] + g[4:] for g in got] == [e[:3] + e[4:] for e in expected], rank
        assert torch.allclose(torch.tensor([x for g in got for x in g[3]]),
                              torch.tensor([x for e in expected for x in e[3]]))


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-vllm-tp{r}" for m, _, r in CASES])
def test_prompts_are_split_over_rollout_data_parallelism(engines, case):
    model, (tp, pp), rollout_tp = case
    from megarl.rollout.data_parallel import shard_bounds

    per_rank = [r[(model, tp, pp, rollout_tp)]["generated"] for r in engines]
    engines_n = WORLD // rollout_tp
    for rank, generated in enumerate(per_rank):
        assert len(generated) == 1
        start, stop = shard_bounds(len(PROMPTS), rank // rollout_tp, engines_n)
        # each engine its share (one request per sample), every rank of the engine the same
        assert generated[0] == [p for p in PROMPTS[start:stop] for _ in range(SAMPLING["n"])], rank


def test_ranks_of_one_engine_must_make_the_same_calls(engines):
    # the last case has 2 engines of TP=2: splitting over the world gives its two ranks different shares
    assert all("made different generate calls" in r["split_over_world"] for r in engines), engines[0]
    assert FAKE not in sys.path  # the fake lives in the spawned ranks only (later worlds inherit this path)


def test_fp8_engines_hold_the_quantised_shards_and_take_every_vllm_knob(engines):
    for rank, r in enumerate(engines):
        f = r["fp8"]
        assert not f["wrong_reshard"] and not f["wrong_writer"], (rank, f["wrong_reshard"], f["wrong_writer"])
        assert f["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"], f["dtypes"]
        assert f["same_samples"], rank
        assert f["kwargs"]["compilation_config"] == {"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 8}
        assert (f["kwargs"]["async_scheduling"], f["kwargs"]["max_num_seqs"], f["kwargs"]["max_num_batched_tokens"]) == \
            (True, 8, 64)


def test_the_trainer_generates_with_rollout_tp_2(engines):
    from megarl.rollout.data_parallel import shard_bounds

    runs = [r["trainer"] for r in engines]
    prompts = runs[0]["prompts"]
    for rank, run in enumerate(runs):
        start, stop = shard_bounds(len(prompts), rank // 2, WORLD // 2)  # engines of ranks {0, 1} and {2, 3}
        assert run["generated"] == [[p for p in prompts[start:stop] for _ in range(2)]], rank
        same = {k: v for k, v in run["metrics"].items() if k.split("/")[0] in ("reward", "response", "actor")}
        assert same == {k: runs[0]["metrics"][k] for k in same}, rank  # every rank has every sample: one batch
    m = runs[0]["metrics"]
    assert m["reshard/bytes_sent"] > 0 and 0 <= m["reward/mean"] <= 1
