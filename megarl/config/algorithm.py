"""The RL algorithm's section (``algorithm``): advantage estimator, policy and value losses, KL, rollout correction,
DAPO's dynamic sampling and overlong shaping, non-finite numbers. The allowed names come from
:mod:`megarl.algos.registry`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.algos.registry import (ADVANTAGES, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTION_LEVELS,
                                   ROLLOUT_CORRECTION_MODES, ROLLOUT_CORRECTION_PRESETS)
from megarl.config.errors import require

ROLLOUT_CORRECTION_OFF = "none"  # algorithm.rollout_correction.preset that turns it off, also where it defaults on


@dataclass
class KLConfig:
    """KL to the reference policy.

    Attributes:
        coef: weight of the KL term (0 = no reference model is built).
        estimator: a registered KL estimator: k1, k2, k3 (Schulman's) or k3+ (k3's value, k2's gradient).
        in_loss: add the KL to the loss (GRPO style) rather than subtract it from the token rewards (PPO style).
            As a loss only the estimator's gradient counts: k1's estimates no KL gradient and is refused
            (see megarl.algos.kl).
        target: adaptive controller's target KL (null = fixed coefficient); horizon: its horizon, samples.
    """

    coef: float = 0.001
    estimator: str = "k3"
    in_loss: bool = True
    target: Optional[float] = None
    horizon: int = 10000

    def __post_init__(self):
        require(self.coef >= 0, "algorithm.kl.coef", "must be >= 0")
        require(self.estimator in KL_ESTIMATORS, "algorithm.kl.estimator",
                 f"must be one of {KL_ESTIMATORS.names()}, got {self.estimator!r}")
        if self.in_loss and self.coef > 0:
            fit = [n for n in KL_ESTIMATORS.names() if KL_ESTIMATORS.entry(n).loss_gradient]
            require(self.estimator in fit, "algorithm.kl.estimator",
                     f"{self.estimator!r} in the loss (algorithm.kl.in_loss=true): its gradient does not estimate the "
                     "gradient of a KL (k1's is zero in expectation: it does not pull the policy towards the "
                     f"reference; see megarl.algos.kl); use one of {fit} in the loss, or set "
                     f"algorithm.kl.in_loss=false to subtract {self.estimator} from the reward")


@dataclass
class RolloutCorrectionConfig:
    """Importance weights between the actor's old log-probs and the rollout engine's, applied to every policy
    loss (``megarl.algos.rollout_correction``). Off by default (``level: null``), except with FP8 rollouts
    (``rollout.quantization: fp8`` or ``rollout.kv_cache_dtype: fp8``: token-level TIS, ``preset: token_tis``, as
    verl and NVIDIA's FP8 recipes); the
    metrics ``rollout_corr/...`` (k3 KL rollout vs old, ratio mean/min/max, fractions truncated or masked) are
    logged every step whatever the setting.

    Attributes:
        preset: fills the fields left null: "token_tis", "seq_tis" (truncate at 2), "token_mis", "seq_mis"
            (mask outside [0.5, 2]), "icepop" (token mask outside [0.5, 5]); "none": off (also with FP8
            rollouts); null = none, or token_tis with FP8 rollouts.
        level: "token", "sequence", or null (off).
        mode: "truncate" (TIS: weight min(ratio, cap)) or "mask" (MIS: outside [lower, cap] leaves the loss);
            null = "truncate".
        cap: TIS's cap C (> 0) or MIS's upper bound (>= 1); null = 2.0.
        lower: MIS's lower bound, in [0, 1]; null = 0.5.
    """

    preset: Optional[str] = None
    level: Optional[str] = None
    mode: Optional[str] = None
    cap: Optional[float] = None
    lower: Optional[float] = None

    def __post_init__(self):
        require(self.preset in (None, ROLLOUT_CORRECTION_OFF, *ROLLOUT_CORRECTION_PRESETS),
                "algorithm.rollout_correction.preset",
                f"must be one of {[*ROLLOUT_CORRECTION_PRESETS, ROLLOUT_CORRECTION_OFF]} or null, got {self.preset!r}")
        require(self.preset != ROLLOUT_CORRECTION_OFF or self.level is None, "algorithm.rollout_correction.level",
                f"is {self.level!r} but preset=none turns the correction off; leave one of them null")
        level, mode, cap, lower = self.settings() if self.enabled else (None, "truncate", 2.0, 0.5)
        require(self.level is None or self.level in ROLLOUT_CORRECTION_LEVELS, "algorithm.rollout_correction.level",
                 f"must be one of {ROLLOUT_CORRECTION_LEVELS} or null (off), got {self.level!r}")
        require(mode in ROLLOUT_CORRECTION_MODES, "algorithm.rollout_correction.mode",
                 f"must be one of {ROLLOUT_CORRECTION_MODES}, got {mode!r}")
        require(cap > 0, "algorithm.rollout_correction.cap", f"must be > 0, got {cap}")
        require(mode == "truncate" or 0 <= lower <= 1 <= cap, "algorithm.rollout_correction",
                 f"mask needs 0 <= lower <= 1 <= cap (ratio 1 must stay in the loss), got lower={lower}, cap={cap}")

    @property
    def enabled(self) -> bool:
        """A level is set, by the field or by the preset (not "none")."""
        return self.level is not None or self.preset not in (None, ROLLOUT_CORRECTION_OFF)

    def settings(self) -> tuple[str, str, float, float]:
        """``(level, mode, cap, lower)``: the fields, those left null from the preset, then the defaults."""
        preset = ROLLOUT_CORRECTION_PRESETS.get(self.preset, (None, None, None, None))
        given = (self.level, self.mode, self.cap, self.lower)
        return tuple(g if g is not None else p if p is not None else d
                     for g, p, d in zip(given, preset, (None, "truncate", 2.0, 0.5)))


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2): groups whose rewards are all equal
    carry no signal (zero advantage) and are dropped; more prompts are generated until the step has
    ``data.prompts_per_step`` groups with signal, or ``max_extra_rounds`` more rounds of
    ``data.prompts_per_step`` prompts ran (then the step trains on what there is, in whole mini-batches; the
    ``dynamic_sampling/...`` metrics say how many groups).

    Attributes:
        enabled: drop tied groups and refill.
        max_extra_rounds: generation rounds after the first, at most (>= 0).
    """

    enabled: bool = False
    max_extra_rounds: int = 3

    def __post_init__(self):
        require(self.max_extra_rounds >= 0, "algorithm.dynamic_sampling.max_extra_rounds",
                 f"must be >= 0, got {self.max_extra_rounds}")


@dataclass
class OverlongConfig:
    """DAPO's handling of long responses (Yu et al. 2025, arXiv:2503.14476, sec. 3.4).

    Attributes:
        buffer_tokens: L_cache of the soft overlong punishment (eq. 13): a response longer than
            ``rollout.max_new_tokens - buffer_tokens`` loses up to ``penalty_factor`` of reward, linearly, -1 x
            factor at the limit; 0 = no shaping.
        penalty_factor: scale of that penalty (>= 0).
        filter: overlong filtering: responses cut at ``rollout.max_new_tokens`` leave the loss (still counted
            in the reward metrics and in their group's advantages).
    """

    buffer_tokens: int = 0
    penalty_factor: float = 1.0
    filter: bool = False

    def __post_init__(self):
        require(self.buffer_tokens >= 0, "algorithm.overlong.buffer_tokens", f"must be >= 0, got {self.buffer_tokens}")
        require(self.penalty_factor >= 0, "algorithm.overlong.penalty_factor",
                 f"must be >= 0, got {self.penalty_factor}")


@dataclass
class NonFiniteConfig:
    """What a step does with non-finite numbers from the rollout engine and the reward
    (``megarl.algos.nonfinite``): a token whose rollout log-prob is not finite leaves the loss, a sample whose
    score is not finite is dropped from its group (``rollout/nonfinite_logprob_tokens``, ``reward/nonfinite``),
    and past ``max_fraction`` the step fails naming the first such sample.

    Attributes:
        max_fraction: the share of a step's samples that may carry a non-finite rollout log-prob or score, in
            [0, 1]; 0 fails on the first one, 1 never fails.
    """

    max_fraction: float = 0.05

    def __post_init__(self):
        require(0 <= self.max_fraction <= 1, "algorithm.nonfinite.max_fraction",
                f"must be in [0, 1] (a share of the step's samples), got {self.max_fraction}")


@dataclass
class DistillConfig:
    """On-policy distillation (:mod:`megarl.algos.distill`): a teacher scores every token the student sampled,
    and the per-token reverse KL ``log p_student - log p_teacher`` is a negative advantage, with the task reward's
    advantage mixed in. Off while ``teacher`` is null.

    Attributes:
        teacher: the teacher model, any ``model.path`` form megarl reads (HF directory, megarl checkpoint, GGUF
            file), of any size, with the student's tokenizer; it takes the reference's slot (``placement.reference``,
            ``placement.reference_parallel``).
        coef: the reverse KL's weight in the advantage (> 0).
        reward_coef: the weight of ``algorithm.name``'s task-reward advantage (0: distillation alone).
    """

    teacher: Optional[str] = None
    coef: float = 1.0
    reward_coef: float = 0.0

    def __post_init__(self):
        require(self.coef > 0, "algorithm.distill.coef", f"must be > 0 (the reverse KL's weight), got {self.coef}")
        require(self.reward_coef >= 0, "algorithm.distill.reward_coef", f"must be >= 0, got {self.reward_coef}")


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy/value losses, KL.

    Each advantage estimator and policy loss takes its parameters from these fields, as its registry entry
    says (``megarl.algos.registry``).

    Attributes:
        name: the advantage estimator (registry names): "grpo", "ppo" (= "gae": GAE with a critic), "rloo",
            "reinforce_plus_plus", "reinforce_plus_plus_baseline", or one registered by the user.
        policy_loss: the registered policy loss: "ppo" (the clipped surrogate), "gspo" (sequence-level ratio;
            clip ranges ~3e-4/4e-4, loss_agg_mode seq-mean-token-mean), "cispo" (clipped, stop-gradient weight
            times log-prob; clip_ratio_low 1.0 = no lower bound).
        gamma / lam: discount and GAE lambda.
        whiten_advantages: GAE whitens the advantages over the batch.
        norm_adv_by_std: GRPO divides by the group std (Dr. GRPO: false); norm_adv_eps: added to that std.
        clip_ratio_low / clip_ratio_high: PPO clip range [1 - low, 1 + high] (clip-higher when high > low).
        clip_ratio_c: dual-clip bound for negative advantages (null = off; typical 3.0).
        loss_agg_mode: token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (Dr.
            GRPO: each response's token sum over the constant loss_norm_tokens).
        loss_norm_tokens: the constant of seq-mean-token-sum-norm, tokens; null = rollout.max_new_tokens.
        rollout_correction / dynamic_sampling / overlong / nonfinite / distill: see their sections.
        entropy_coef: entropy bonus weight.
        value_clip: PPO value clipping range; vf_coef: value-loss weight.
    """

    name: str = "grpo"
    policy_loss: str = "ppo"
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    norm_adv_by_std: bool = True
    norm_adv_eps: float = 1e-6
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    loss_norm_tokens: Optional[int] = None
    entropy_coef: float = 0.0
    value_clip: float = 0.2
    vf_coef: float = 1.0
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        require(self.distill.teacher is None or self.kl.coef == 0, "algorithm.kl.coef",
                f"must be 0 with algorithm.distill.teacher (got {self.kl.coef}): the teacher takes the reference's "
                "slot, and the distillation signal is already a KL to it; set algorithm.kl.coef=0")
        require(self.distill.teacher is None or self.distill.reward_coef > 0 or not self.dynamic_sampling.enabled,
                "algorithm.dynamic_sampling.enabled", "drops groups whose task rewards tie, but distillation without "
                "a task reward (algorithm.distill.reward_coef=0) learns from every group; set it to false")
        require(self.name in ADVANTAGES, "algorithm.name", f"unknown algorithm {self.name!r}; choose one of "
                 f"{ADVANTAGES.names()}")
        require(self.policy_loss in POLICY_LOSSES, "algorithm.policy_loss",
                 f"unknown policy loss {self.policy_loss!r}; choose one of {POLICY_LOSSES.names()}")
        require(self.loss_agg_mode in AGG_MODES, "algorithm.loss_agg_mode",
                 f"must be one of {AGG_MODES}, got {self.loss_agg_mode!r}")
        require(self.norm_adv_eps >= 0, "algorithm.norm_adv_eps", f"must be >= 0, got {self.norm_adv_eps}")
        require(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma/lam", "must be in [0, 1]")
        require(self.clip_ratio_low >= 0 and self.clip_ratio_high >= 0, "algorithm.clip_ratio_low/high",
                 "must be >= 0")
        require(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algorithm.clip_ratio_c",
                 "must be > 1 (or null to disable dual-clip)")
        require(self.loss_norm_tokens is None or self.loss_norm_tokens >= 1, "algorithm.loss_norm_tokens",
                 f"must be >= 1 or null (rollout.max_new_tokens), got {self.loss_norm_tokens}")

    @property
    def uses_critic(self) -> bool:
        """The advantage estimator needs a critic's values."""
        return "values" in ADVANTAGES.entry(self.name).needs

    @property
    def uses_reference(self) -> bool:
        """A model in the reference's slot: the KL's reference policy (``kl.coef > 0``) or the distillation's
        teacher (``distill.teacher``)."""
        return self.kl.coef > 0 or self.distill.teacher is not None
