"""Checks of a run against its model, made before any process or model starts.

:func:`~megarl.parallel.placement.validate_for_world` checks what the config and the world size determine;
:func:`validate_for_model` adds what the model's own config (``config.json``, GGUF metadata or a preset)
determines: whether its heads, query groups, FFN and vocab split at each role's TP, whether its layers split
at the PP size, whether the rollout engine's TP fits it, whether its context holds a prompt and a response.
:func:`preflight` adds the tokenizer, the train and validation files, the reward function and what this machine needs, and is what
``megarl train`` (and ``megarl bench step``) run in the launching process, before torchrun starts any rank.
The :class:`~megarl.trainer.trainer.Trainer` runs :func:`validate_for_model` again on every rank (a job
started by torchrun or srun), before it builds a model.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import torch

from megarl.config import Config, ConfigError
from megarl.parallel.placement import validate_for_world
from megarl.models.checkpoint import source_spec
from megarl.models.hf_io import load_tokenizer
from megarl.models.layout import check_vllm_tp
from megarl.models.megatron import check_layout
from megarl.models.spec import ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout
from megarl.rewards.registry import RewardError, find_reward, load_reward_fn


def model_spec(cfg: Config) -> ModelSpec:
    """The spec of ``model.path``, read from its config alone (no weight is loaded).

    Raises:
        ConfigError: naming ``model.path``: no such path, an unknown architecture or an unsupported feature.
    """
    return _model_source(cfg)[0]


def _model_source(cfg: Config) -> tuple[ModelSpec, str | None]:
    """:func:`~megarl.models.checkpoint.source_spec` of ``model.path``: its spec and its tokenizer's location.

    Raises:
        ConfigError: as :func:`model_spec`.
    """
    try:
        spec, _, tokenizer = source_spec(None if cfg.model.path == "default" else cfg.model.path)
    except (FileNotFoundError, SpecError) as e:
        raise ConfigError(f"model.path: {e}") from None
    return spec, tokenizer


def tokenizer_source(cfg: Config, model_tokenizer: str | None) -> str:
    """``model.tokenizer``, else the model's own tokenizer (``model_tokenizer``, from
    :func:`~megarl.models.checkpoint.source_spec`).

    Raises:
        ConfigError: naming ``model.tokenizer`` when neither is there (a preset names none).
    """
    source = cfg.model.tokenizer or model_tokenizer
    if source is None:
        raise ConfigError(f"model.tokenizer: {cfg.model.path} has no tokenizer; name a tokenizer directory")
    return source


def validate_for_model(cfg: Config, spec: ModelSpec) -> None:
    """Check that ``spec`` runs under ``cfg``.

    Raises:
        ConfigError: naming the field (``actor.parallel.tp``, ``actor.parallel.pp``, ``actor.parallel.ep``, ``critic.parallel.tp``,
            ``placement.reference_parallel.tp``, ``rollout.tp``, ``rollout.max_model_len``, ``rollout.max_new_tokens``), what does not divide or
            fit, and the sizes that would.
    """
    meshes = [("actor.parallel", cfg.actor.parallel)]
    if cfg.algorithm.uses_critic:
        meshes.append(("critic.parallel", cfg.critic.parallel))
    if cfg.algorithm.kl.coef > 0 and cfg.placement.reference_parallel is not None:
        meshes.append(("placement.reference_parallel", cfg.placement.reference_parallel))
    for field_name, p in meshes:
        for name, layout in (("tp", ParallelLayout(tp=p.tp)), ("pp", ParallelLayout(pp=p.pp))):
            try:
                check_layout(spec, layout)
            except SpecError as e:
                raise ConfigError(f"{field_name}.{name}: {e}") from None
    ep = cfg.actor.parallel.ep
    try:  # the experts it splits (the tp x dp it must divide is checked with the world: placement.global_layout)
        check_layout(spec, ParallelLayout(dp=ep, ep=ep))
    except SpecError as e:
        raise ConfigError(f"actor.parallel.ep: {e}") from None
    r = cfg.rollout
    if r.engine == "vllm":
        try:
            check_vllm_tp(spec, r.tp)
        except SpecError as e:
            raise ConfigError(f"rollout.tp: {e}") from None
    context = spec.max_position_embeddings
    if r.max_model_len is not None and r.max_model_len > context:
        raise ConfigError(f"rollout.max_model_len: {r.max_model_len} exceeds the model's context "
                          f"max_position_embeddings={context}; use at most {context} (or null)")
    limit = r.max_model_len or context
    if cfg.data.max_prompt_length + r.max_new_tokens > limit:
        raise ConfigError(f"rollout.max_new_tokens: data.max_prompt_length ({cfg.data.max_prompt_length}) + "
                          f"rollout.max_new_tokens ({r.max_new_tokens}) exceeds the model's context of {limit} "
                          "tokens; shorten one of them")


def check_files(cfg: Config, field: str, files: list[str], alternative: str = "") -> None:
    """Raises ConfigError naming ``field`` when one of its ``files`` is missing and ``data.prepare`` cannot
    make it; ``alternative`` ends the message (another way out, e.g. `` (or validation.enabled=false)``)."""
    missing = [f for f in files if not Path(f).is_file()]
    if missing and cfg.data.prepare is None:
        raise ConfigError(f"{field}: {missing} do not exist; create them or set data.prepare=gsm8k{alternative}")


def check_data_files(cfg: Config) -> None:
    """:func:`check_files` of ``data.train_files`` and, when validation is on, ``validation.files``."""
    check_files(cfg, "data.train_files", cfg.data.train_files)
    if cfg.validation.enabled:
        check_files(cfg, "validation.files", cfg.validation.files, " (or validation.enabled=false)")


def check_reward(cfg: Config) -> None:
    """Find ``reward.fn`` and, for a function, bind ``reward.kwargs`` to it (a class is built on the ranks).

    Raises:
        ConfigError: naming ``reward.fn``: unknown name, unimportable path, parameters it does not take.
    """
    try:
        if not inspect.isclass(find_reward(cfg.reward.fn)):
            load_reward_fn(cfg.reward.fn, cfg.reward.kwargs)
    except RewardError as e:
        raise ConfigError(f"reward.fn: {e}") from None


def check_tokenizer(cfg: Config, model_tokenizer: str | None) -> None:
    """The tokenizer of :func:`tokenizer_source` loads.

    Raises:
        ConfigError: naming ``model.tokenizer``, the path and what a tokenizer folder needs.
    """
    try:
        load_tokenizer(tokenizer_source(cfg, model_tokenizer))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"model.tokenizer: {e}") from None


def check_this_machine(cfg: Config) -> None:
    """What this machine must have for a job of its own ranks: vLLM rollouts need vLLM and a GPU.

    Raises:
        ConfigError: naming ``rollout.engine`` and the fix.
    """
    if cfg.rollout.engine == "vllm" and not torch.cuda.is_available():
        raise ConfigError("rollout.engine: vllm generates on a GPU and this machine has none; use "
                          "rollout.engine=hf on a CPU")
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine: vllm is not installed (MEGARL_EXTRAS=gpu ./build.sh installs it)")


def preflight(cfg: Config, world_size: int, *, this_machine: bool = True) -> ModelSpec:
    """Every check that needs no process group or model, made by the process that starts a job's ranks on this
    machine: :func:`~megarl.parallel.placement.validate_for_world`, the model (:func:`validate_for_model`), the train
    files, the reward function and, with ``this_machine``, what this machine must have (``--check`` leaves it
    out: a GPU config checked on a CPU machine). Returns the model's spec.

    Raises:
        ConfigError: naming the field.
    """
    validate_for_world(cfg, world_size)
    spec, model_tokenizer = _model_source(cfg)
    validate_for_model(cfg, spec)
    check_tokenizer(cfg, model_tokenizer)
    check_data_files(cfg)
    check_reward(cfg)
    if this_machine:
        check_this_machine(cfg)
    return spec
