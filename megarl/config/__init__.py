"""Run configuration: dataclasses with the CPU default embedded, YAML loading and validation.

``megarl train [CONFIG.yaml] [key=value ...]`` merges, in order: the defaults below (the CPU default: GRPO on
the arithmetic task with SmolLM2-135M-Instruct, transformers rollouts), the YAML file, and dotted overrides
(``actor.optim.lr=1e-6``, OmegaConf syntax). Every field is type-checked by OmegaConf and validated by the
dataclasses' ``__post_init__``; :func:`megarl.parallel.placement.validate_for_world` then checks what depends
on the job's world size (the roles' layouts on their pools).
All of this happens before any model is built, and every error names the field and the fix.

One module per area: :mod:`~megarl.config.errors` (``ConfigError``, ``require``), :mod:`~megarl.config.roles`
(model, the Megatron roles and their placement), :mod:`~megarl.config.rollout` (data, generation, reward,
reshard), :mod:`~megarl.config.algorithm`, :mod:`~megarl.config.run` (:class:`Config` itself, the loop,
validation, launch) and :mod:`~megarl.config.loading` (YAML and overrides). Import every name from here.
"""

from megarl.config.algorithm import (AlgorithmConfig, DistillConfig, DynamicSamplingConfig, KLConfig, NonFiniteConfig,
                                     OverlongConfig, ROLLOUT_CORRECTION_OFF, RolloutCorrectionConfig)
from megarl.config.errors import ConfigError, require
from megarl.config.loading import absolute_paths, load_config, to_dict
from megarl.config.offline import DPOConfig, DPORunConfig, OfflineDataConfig, SFTConfig, SFTRunConfig
from megarl.config.roles import (ATTENTION_KERNELS, ActorConfig, CriticConfig, DTYPES, DTYPE_TABLE, Dtype,
                                 KernelsConfig, LORA_SYNC, LORA_TARGETS, LoRAConfig, MEGATRON_ROLES, MOE_DISPATCHERS,
                                 MOE_EXPERTS, MoEConfig, ModelConfig, OLD_LOGPROB_PASSES, OptimConfig, ParallelConfig,
                                 PlacementConfig, ROLES)
from megarl.config.rollout import (DataConfig, JUDGE_BACKENDS, JUDGE_FIELDS, JUDGE_VERDICTS, JudgeConfig, MIN_BUCKET_MB,
                                   MODEL_RUNNERS, MultiTurnConfig, PREPARED, QUANTIZATIONS, ReshardConfig, RewardConfig,
                                   RolloutConfig)
from megarl.config.run import (Config, LAUNCH_ENV, LOGGERS, LOGGER_PACKAGES, LaunchConfig, RunConfig, TrainerConfig,
                               ValidationConfig)

__all__ = ['ATTENTION_KERNELS', 'ActorConfig', 'AlgorithmConfig', 'Config', 'ConfigError', 'CriticConfig', 'DPOConfig',
           'DPORunConfig', 'DTYPES', 'DTYPE_TABLE', 'DataConfig', 'DistillConfig', 'Dtype', 'DynamicSamplingConfig',
           'JUDGE_BACKENDS', 'JUDGE_FIELDS', 'JUDGE_VERDICTS', 'JudgeConfig', 'KLConfig', 'KernelsConfig', 'LAUNCH_ENV',
           'LOGGERS', 'LOGGER_PACKAGES', 'LORA_SYNC', 'LORA_TARGETS', 'LaunchConfig', 'LoRAConfig', 'MEGATRON_ROLES',
           'MIN_BUCKET_MB', 'MODEL_RUNNERS', 'MOE_DISPATCHERS', 'MOE_EXPERTS', 'MoEConfig', 'ModelConfig',
           'MultiTurnConfig', 'NonFiniteConfig', 'OLD_LOGPROB_PASSES', 'OfflineDataConfig', 'OptimConfig',
           'OverlongConfig', 'PREPARED', 'ParallelConfig', 'PlacementConfig', 'QUANTIZATIONS', 'ROLES',
           'ROLLOUT_CORRECTION_OFF', 'ReshardConfig', 'RewardConfig', 'RolloutConfig', 'RolloutCorrectionConfig',
           'RunConfig', 'SFTConfig', 'SFTRunConfig', 'TrainerConfig', 'ValidationConfig', 'absolute_paths',
           'load_config', 'require', 'to_dict']
