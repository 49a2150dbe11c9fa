"""The registries carry the algorithms all the way: the config's allowed names come from them, each algorithm's
parameters are read from the config by its registry entry, and the trainer names no algorithm."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.algos.registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES
from megarl.config import AlgorithmConfig, ConfigError, load_config
from megarl.parallel.placement import validate_for_world

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("registry", [ADVANTAGES, POLICY_LOSSES], ids=["advantages", "policy_losses"])
def test_every_entry_reads_existing_config_fields_into_existing_parameters(registry):
    cfg = AlgorithmConfig()
    for name in registry.names():
        entry = registry.entry(name)
        params = entry.config_params(cfg)  # an AttributeError here: a field the config lacks
        inspect.signature(entry.fn).bind_partial(**params)  # a TypeError here: a keyword the function lacks


def test_config_parameters_reach_the_estimator_and_the_loss():
    scores, mask, group = torch.tensor([1.0, 0.0, 0.0, 2.0]), torch.ones(4, 2), torch.tensor([0, 0, 0, 1])
    grpo = ADVANTAGES.get("grpo")
    for overrides, expected in [([], grpo(scores, mask, group_index=group)),
                                (["algorithm.norm_adv_eps=0.5"], grpo(scores, mask, group_index=group, eps=0.5)),
                                (["algorithm.norm_adv_by_std=false"],
                                 grpo(scores, mask, group_index=group, norm_by_std=False))]:
        alg = load_config(None, overrides).algorithm
        torch.testing.assert_close(ADVANTAGES.bind(alg.name, alg)(scores, mask, group_index=group), expected)
    assert grpo(scores, mask, group_index=group)[0][0, 0] != grpo(scores, mask, group_index=group, eps=0.5)[0][0, 0]
    alg = load_config(None, ["algorithm.clip_ratio_high=0.28", "algorithm.clip_ratio_c=3.0"]).algorithm
    assert POLICY_LOSSES.entry(alg.policy_loss).config_params(alg) == {
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    gae = load_config(None, ["algorithm.name=ppo", "algorithm.gamma=0.9", "algorithm.whiten_advantages=false"])
    assert ADVANTAGES.entry(gae.algorithm.name).config_params(gae.algorithm) == {
        "gamma": 0.9, "lam": 1.0, "whiten": False}


def test_allowed_names_are_the_registries():
    for name in ADVANTAGES.names():
        alg = AlgorithmConfig(name=name)
        assert alg.uses_critic == ("values" in ADVANTAGES.entry(name).needs)
    assert AlgorithmConfig(name="ppo").uses_critic and not AlgorithmConfig(name="grpo").uses_critic
    with pytest.raises(ConfigError, match=r"algorithm.name: unknown algorithm 'ppo2'.*'reinforce_plus_plus_baseline'"):
        load_config(None, ["algorithm.name=ppo2"])
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss: .*'gspo2'.*\['cispo', 'gspo', 'ppo'\]"):
        load_config(None, ["algorithm.policy_loss=gspo2"])
    with pytest.raises(ConfigError, match=r"algorithm.kl.estimator: .*'k3\+'.*'k4'"):
        load_config(None, ["algorithm.kl.estimator=k4"])
    with pytest.raises(ConfigError, match="algorithm.loss_agg_mode"):
        load_config(None, ["algorithm.loss_agg_mode=mean"])
    # groups need several samples per prompt, whichever estimator asks for them
    cfg = load_config(None, ["algorithm.name=reinforce_plus_plus_baseline", "rollout.n=1",
                             "actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match="rollout.n"):
        validate_for_world(cfg, 1)
    validate_for_world(load_config(None, ["algorithm.name=reinforce_plus_plus", "rollout.n=1",
                                          "actor.ppo_mini_batch_size=4"]), 1)


def test_a_user_estimator_becomes_a_valid_name_with_its_own_parameters():
    from megarl.algos.advantages import register_advantage

    @register_advantage("test_scaled", params={"scale": "gamma"}, needs=("group_index",))
    def scaled(rewards, response_mask, *, values=None, group_index=None, scale=1.0):
        adv = response_mask.float() * scale
        return adv, adv

    try:
        alg = load_config(None, ["algorithm.name=test_scaled", "algorithm.gamma=0.5"]).algorithm
        adv, _ = ADVANTAGES.bind(alg.name, alg)(torch.zeros(2), torch.ones(2, 3), group_index=torch.tensor([0, 0]))
        assert adv.sum().item() == 0.5 * 6 and not alg.uses_critic
    finally:
        ADVANTAGES._entries.pop("test_scaled")


def test_trainer_and_workers_name_no_algorithm():
    sources = [f.read_text() for d in ("megarl/trainer", "megarl/workers") for f in sorted((ROOT / d).glob("*.py"))]
    names = ADVANTAGES.names() + POLICY_LOSSES.names() + KL_ESTIMATORS.names()
    for text in sources:
        assert [n for n in names if f'"{n}"' in text or f"'{n}'" in text] == []


def test_config_imports_no_torch():
    code = "import sys, megarl.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
