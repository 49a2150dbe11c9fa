"""``rollout.overlap_scoring`` (:mod:`megarl.rollout.overlap`): the step that scores finished groups while the
others generate gives the sequential step's results bit for bit, on two gloo ranks (TP=2, DP=2, PP=2), and the
combinations it does not cover are refused with one line naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import ConfigError, load_config
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_each_on_rank, write_prompts

# 4 prompts x 4 samples of up to 8 tokens, decoded 4 rows at a time (groups finish one after another), two
# mini-batches (the old-log-prob pass runs), the KL in the loss (the reference's pass runs); two steps
STEPS = ["trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
         "rollout.max_new_tokens=8", "rollout.max_batch_size=4", "actor.ppo_mini_batch_size=8",
         "actor.micro_batch_size=2", "actor.optim.lr=1e-2", "algorithm.kl.coef=0.01"]
TIMED = ("time/", "throughput/", "pool/", "overlap/", "offload/", "reshard/", "perf/", "mfu/", "memory/")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 16)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["actor.parallel.tp=2"], ["actor.parallel.dp=2"], ["actor.parallel.pp=2"]],
                         ids=["tp2", "dp2", "pp2"])
def test_overlap_gives_the_sequential_steps_metrics_and_weights_bit_for_bit(task, layout):
    root, model, data = task
    name = layout[0].split(".")[-1].replace("=", "")
    runs = run_world(train_each_on_rank, 2, [task_overrides(model, data, root / "runs", f"{name}-{mode}") + STEPS
                                             + layout + [f"rollout.overlap_scoring={mode == 'on'}"]
                                             for mode in ("off", "on")])
    (seq, seq_weights), (ovl, ovl_weights) = runs[0]
    assert len(seq) == len(ovl) == 2
    for a, b in zip(seq, ovl):
        assert b["overlap/units"] == 4 and b["overlap/early_units"] >= 1  # units of one group, some while generating
        assert "actor/kl" in a and a["actor/ppo_kl"] != 0  # the reference's and the old-log-prob passes ran
        same = {k: v for k, v in a.items() if not k.startswith(TIMED)}
        assert same == {k: b[k] for k in same}
    for rank in runs:
        assert rank[0][1].keys() == rank[1][1].keys()
        for n, t in rank[0][1].items():
            assert t.equal(rank[1][1][n]), n


@pytest.mark.parametrize("override,field", [
    ("rollout.multi_turn.enabled=true", "rollout.multi_turn.enabled"),
    ("algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.enabled"),
    ("trainer.mode=async", "trainer.mode"),
    ("placement.rollout=gen", "placement.rollout"),
    ("actor.offload=true", "actor.offload"),
    ("reward.fn=reward_model", "reward.fn"),
])
def test_what_overlap_does_not_cover_is_refused_naming_the_field(override, field):
    extra = (["placement.pools={all: all, gen: [1]}"] if "placement" in override else [])
    with pytest.raises(ConfigError, match=f"^{field}: .*rollout.overlap_scoring=false"):
        load_config(None, ["rollout.overlap_scoring=true", override] + extra)


class _Requests:
    """The transformers engine behind its request interface alone (as :func:`~megarl.rollout.overlap.open_stream`
    drives vLLM): no ``generate_stream``."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        if name == "generate_stream":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        if name == "engine":
            super().__setattr__(name, value)
        else:
            setattr(self.engine, name, value)


@pytest.mark.usefixtures("one_thread")
def test_the_engine_streams_give_generates_samples_as_they_finish():
    """The transformers engine's stream (one decode step a ``next``) and the request path vLLM's stream takes give
    the samples of ``generate`` (same seeds from the call counter, which each advances by one), the stream's spread
    over the steps in which they finished."""
    from megarl.rollout.base import SamplingConfig, state_dict_writer
    from megarl.rollout.hf_engine import HFRolloutEngine
    from megarl.rollout.overlap import open_stream
    from tests.test_rollout_hf_engine import PROMPTS, TINY, random_state_dict

    engine = HFRolloutEngine(TINY, max_batch_size=4)
    engine.update_weights(state_dict_writer(random_state_dict(TINY, 3), engine.weight_layout([0]), 0))
    free = SamplingConfig(n=2, max_new_tokens=8, seed=5)
    engine.calls = 4  # the tokens some samples say early end them: samples of many lengths
    stops = {s.token_ids[k] for k, s in zip((1, 3, 5, 6), engine.generate(PROMPTS, free, prompt_offset=3).samples)}
    sampling = dataclasses.replace(free, stop_token_ids=tuple(stops))
    engine.calls = 4
    want = engine.generate(PROMPTS, sampling, prompt_offset=3).samples
    assert len({len(s.token_ids) for s in want}) > 3  # lengths spread: samples finish at different steps
    for source in (engine, _Requests(engine)):
        engine.calls = 4
        steps = list(open_stream(source, PROMPTS, sampling, prompt_offset=3))
        assert engine.calls == 5
        got = sorted((s for step in steps for s in step), key=lambda s: (s.prompt_index, s.sample_index))
        assert [(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in got] == \
               [(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in want]
        assert all(a.logprobs.equal(b.logprobs) for a, b in zip(got, want))
        if source is engine:
            assert sum(1 for step in steps if step) > 4  # finished over many steps, not all at the end


def test_bench_step_reports_the_overlap_figures_as_means_of_the_measured_steps():
    from megarl.bench.step import overlap_figures

    history = [{"overlap/units": 8, "overlap/wait_s": 0.5, "time/step": 3.0},
               {"overlap/units": 8, "overlap/wait_s": 0.25, "time/step": 2.0}]
    assert overlap_figures(history) == {"units": 8.0, "wait_s": 0.375}
    assert overlap_figures([{"time/step": 1.0}]) == {}


def test_a_moe_actor_is_refused_before_any_model():
    from megarl.models.spec import ModelSpec
    from megarl.trainer.preflight import validate_for_model

    moe = ModelSpec("qwen3_moe", vocab_size=16, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                    head_dim=16, ffn_hidden_size=128, max_position_embeddings=512, eos_token_ids=(1,), num_experts=8,
                    moe_top_k=2, moe_ffn_hidden_size=32)
    with pytest.raises(ConfigError, match="^rollout.overlap_scoring: a qwen3_moe model .* cannot overlap scoring"):
        validate_for_model(load_config(None, ["rollout.overlap_scoring=true"]), moe)
