"""Checks of a run against its model, made before any process or model starts.

:func:`~megarl.config.validate_for_world` checks what the config and the world size determine;
:func:`validate_for_model` adds what the model's own config (``config.json``, GGUF metadata or a preset)
determines: whether its heads, query groups, FFN and vocab split at each role's TP, whether its layers split
at the PP size, whether the rollout engine's TP fits it, whether its context holds a prompt and a response.
``megarl train`` runs :func:`preflight` in the launching process, before torchrun starts any rank; the
:class:`~megarl.trainer.trainer.Trainer` runs it again on every rank (a job started by torchrun or srun).
"""

from __future__ import annotations

from megarl.config import Config, ConfigError, validate_for_world
from megarl.models.checkpoint import source_spec
from megarl.models.megatron import check_layout
from megarl.models.spec import ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout
from megarl.models.layout import check_vllm_tp


def model_spec(cfg: Config) -> ModelSpec:
    """The spec of ``model.path``, read from its config alone (no weight is loaded).

    Raises:
        ConfigError: naming ``model.path``: no such path, an unknown architecture or an unsupported feature.
    """
    try:
        return source_spec(None if cfg.model.path == "default" else cfg.model.path)[0]
    except (FileNotFoundError, SpecError) as e:
        raise ConfigError(f"model.path: {e}") from None


def validate_for_model(cfg: Config, spec: ModelSpec) -> None:
    """Check that ``spec`` runs under ``cfg``.

    Raises:
        ConfigError: naming the field (``actor.parallel.tp``, ``actor.parallel.pp``, ``critic.parallel.tp``,
            ``rollout.tp``, ``rollout.max_model_len``, ``rollout.max_new_tokens``), what does not divide or
            fit, and the sizes that would.
    """
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.algorithm.uses_critic else [])
    for role, rc in roles:
        p = rc.parallel
        for name, layout in (("tp", ParallelLayout(tp=p.tp)), ("pp", ParallelLayout(pp=p.pp))):
            try:
                check_layout(spec, layout)
            except SpecError as e:
                raise ConfigError(f"{role}.parallel.{name}: {e}") from None
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


def preflight(cfg: Config, world_size: int) -> ModelSpec:
    """Every check that needs no process group or model: :func:`~megarl.config.validate_for_world` and
    :func:`validate_for_model`. Returns the model's spec.

    Raises:
        ConfigError: naming the field.
    """
    validate_for_world(cfg, world_size)
    spec = model_spec(cfg)
    validate_for_model(cfg, spec)
    return spec
