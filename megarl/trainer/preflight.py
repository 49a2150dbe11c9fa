"""Checks of a run against its model, made before any process or model starts.

:func:`~megarl.parallel.placement.validate_for_world` checks what the config and the world size determine;
:func:`validate_for_model` adds what the model's own config (``config.json``, GGUF metadata or a preset)
determines: whether its heads, query groups, FFN and vocab split at each role's TP, whether its layers split
at the PP size, whether the rollout engine's TP fits it, whether its context holds a prompt and a response.
:func:`preflight` adds the tokenizer, the reward function and its parameters, what this machine needs and the
data (the train and validation files prepared when ``data.prepare`` makes them, then every row read, templated
and tokenised), and is what ``megarl train`` (and ``megarl bench step``) run in the launching process, before
torchrun starts any rank.
The :class:`~megarl.trainer.trainer.Trainer` runs :func:`validate_for_model` again on every rank (a job
started by torchrun or srun), before it builds a model.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import re
from pathlib import Path

import torch

from megarl.config import PREPARED, Config, ConfigError, require
from megarl.data.dataset import PromptDataset, read_rows
from megarl.data.template import DataError, PromptTemplate
from megarl.models.checkpoint import source_spec
from megarl.models.hf_io import check_weight_files, load_tokenizer
from megarl.models.layout_vllm import check_vllm_fp8, check_vllm_rope, check_vllm_tp
from megarl.models.megatron import check_layout
from megarl.models.spec import FAMILIES, ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout
from megarl.parallel.placement import validate_for_world
from megarl.rewards.registry import RewardError, check_reward_params, find_reward, load_reward_fn
from megarl.rewards.reward_model import RewardModel
from megarl.textfiles import FileFormatError
from megarl.workers.teacher import check_teacher

log = logging.getLogger(__name__)
MIN_EXACT_CAPABILITY = (8, 0)  # rollout.exact's GPUs (check_this_machine)


def model_spec(cfg: Config) -> ModelSpec:
    """The spec of ``model.path``, read from its config alone (no weight is loaded).

    Raises:
        ConfigError: naming ``model.path``: no such path, a damaged file (a ``config.json``, a weight file cut
            short), an unknown architecture or an unsupported feature.
    """
    return _model_source(cfg)[0]


def _model_source(cfg: Config) -> tuple[ModelSpec, str | None]:
    """:func:`~megarl.models.checkpoint.source_spec` of ``model.path``: its spec and its tokenizer's location.

    Raises:
        ConfigError: as :func:`model_spec`.
    """
    try:
        spec, _, tokenizer = source_spec(None if cfg.model.path == "default" else cfg.model.path)
    except (FileNotFoundError, SpecError, FileFormatError) as e:
        hint, path = "", str(cfg.model.path)
        missing = isinstance(e, FileNotFoundError) and not os.path.exists(os.path.expanduser(path))
        run = re.match(r"(.*)/checkpoints/step_\d+/?$", path)
        if missing and "MODEL_PATH" not in os.environ and path.startswith("/models/"):  # a GPU config's default
            hint = ("; the GPU configs read model.path from $MODEL_PATH, which is not set: export MODEL_PATH=DIR "
                    "(a local Hugging Face directory) or give model.path=...")
        elif missing and run:  # a checkpoint that an earlier run of the workflow writes (SFT then RL, OPD's teacher)
            hint = (f"; it is a checkpoint of the run {run.group(1)}, which has not written it: run that first, or "
                    "give model.path=...")
        raise ConfigError(f"model.path: {e}{hint}") from None
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
        ConfigError: naming the field (``actor.parallel.tp``, ``actor.parallel.pp``, ``actor.parallel.vpp``,
            ``actor.parallel.ep``, ``actor.moe.router_replay``, ``critic.parallel.tp``,
            ``placement.reference_parallel.tp``, ``rollout.tp``, ``rollout.quantization``, ``rollout.max_model_len``,
            ``rollout.max_new_tokens``, ``rollout.exact``, ``actor.sequence_packing`` with MLA), what does not divide or
            fit, and the sizes that would; what megatron-core refuses to build or train
            (:func:`check_megatron_build`).
    """
    meshes = [("actor.parallel", cfg.actor.parallel)]
    if cfg.algorithm.uses_critic:
        meshes.append(("critic.parallel", cfg.critic.parallel))
    if cfg.algorithm.kl.coef > 0 and cfg.placement.reference_parallel is not None:
        meshes.append(("placement.reference_parallel", cfg.placement.reference_parallel))
    for field_name, p in meshes:
        for name, layout in (("tp", ParallelLayout(tp=p.tp)), ("pp", ParallelLayout(pp=p.pp)),
                             ("cp", ParallelLayout(cp=p.cp)), ("vpp", ParallelLayout(pp=p.pp, vpp=p.vpp))):
            try:
                check_layout(spec, layout)
            except SpecError as e:
                raise ConfigError(f"{field_name}.{name}: {e}") from None
    ep = cfg.actor.parallel.ep
    try:  # the experts it splits (the tp x dp it must divide is checked with the world: placement.global_layout)
        check_layout(spec, ParallelLayout(dp=ep, ep=ep))
    except SpecError as e:
        raise ConfigError(f"actor.parallel.ep: {e}") from None
    require(spec.is_moe or not cfg.actor.moe.router_replay, "actor.moe.router_replay",
            f"a {spec.family} model has no experts to route; set actor.moe.router_replay=false")
    require(not (cfg.rollout.overlap_scoring and spec.is_moe), "rollout.overlap_scoring", f"a {spec.family} model (an "
            "MoE) cannot overlap scoring yet: its old-log-prob pass counts the whole batch's routing; set it to false")
    require(not (cfg.rollout.exact and spec.is_moe), "rollout.exact",
            f"a {spec.family} model (mixture of experts) cannot be exact yet: vLLM's fused experts and megatron's "
            "grouped or sequential ones sum the top-k experts in other orders; use a dense model (llama, mistral, "
            "qwen2) or rollout.exact=false")
    require(not (cfg.rollout.exact and cfg.rollout.engine == "vllm" and spec.sliding_window is not None),
            "rollout.exact", f"a sliding window of {spec.sliding_window} tokens is not wired into the exact pass's "
            "attention (vLLM's FlashAttention over whole sequences); use a model without one or rollout.exact=false")
    for role in ("actor", "critic"):
        require(spec.mla is None or not getattr(cfg, role).sequence_packing, f"{role}.sequence_packing",
                "DeepSeek-V3's multi-latent attention on packed sequences is not compared with transformers yet (its "
                "value heads are narrower than its query/key heads); set sequence_packing=false")
    require(spec.mla is None or not cfg.actor.lora.enabled, "actor.lora.rank", "LoRA adapters on DeepSeek-V3's "
            "multi-latent attention projections are not laid out yet; set actor.lora.rank=0")
    require(spec.deepseek_moe is None or not cfg.actor.moe.router_replay, "actor.moe.router_replay", "router replay "
            f"is not compared yet on {spec.family} (dense first layers, biased sigmoid routing); set "
            "actor.moe.router_replay=false")
    require(spec.gdn is None or not cfg.actor.lora.enabled, "actor.lora.rank", "LoRA adapters on Qwen3.5's gated "
            "DeltaNet projections (its fused in_proj) are not laid out yet; set actor.lora.rank=0")
    require(spec.gdn is None or not cfg.rollout.exact, "rollout.exact", "Qwen3.5's gated DeltaNet runs other "
            "kernels in vLLM (fla's) than in the trainer's exact pass; set rollout.exact=false")
    check_megatron_build(cfg, spec)
    r = cfg.rollout
    if r.engine == "vllm":
        try:
            check_vllm_rope(spec)
        except SpecError as e:
            raise ConfigError(f"model.path: {e}") from None
        try:
            check_vllm_tp(spec, r.tp)
        except SpecError as e:
            raise ConfigError(f"rollout.tp: {e}") from None
        if r.quantization == "fp8":
            try:
                check_vllm_fp8(spec, r.tp)
            except SpecError as e:
                raise ConfigError(f"rollout.quantization: {e}; use rollout.quantization=null (bf16) or another "
                                  "rollout.tp") from None
    context = spec.max_position_embeddings
    if r.max_model_len is not None and r.max_model_len > context:
        raise ConfigError(f"rollout.max_model_len: {r.max_model_len} exceeds the model's context "
                          f"max_position_embeddings={context}; use at most {context} (or null)")
    limit = r.max_model_len or context
    if cfg.data.max_prompt_length + r.max_new_tokens > limit:
        raise ConfigError(f"rollout.max_new_tokens: data.max_prompt_length ({cfg.data.max_prompt_length}) + "
                          f"rollout.max_new_tokens ({r.max_new_tokens}) exceeds the model's context of {limit} "
                          "tokens; shorten one of them")


def _megatron_roles(cfg: Config) -> list[tuple[str, str, object, object, bool]]:
    """``(role, parallel field, ParallelConfig, role config, trained)`` of every Megatron model the run builds:
    the actor, the critic (PPO), the reference on its own pool (``placement.reference_parallel``, the actor's
    config, forward only)."""
    roles = [("actor", "actor.parallel", cfg.actor.parallel, cfg.actor, True)]
    if cfg.algorithm.uses_critic:
        roles.append(("critic", "critic.parallel", cfg.critic.parallel, cfg.critic, True))
    if cfg.algorithm.kl.coef > 0 and cfg.placement.reference_parallel is not None:
        roles.append(("reference", "placement.reference_parallel", cfg.placement.reference_parallel, cfg.actor,
                      False))
    return roles


def check_megatron_build(cfg: Config, spec: ModelSpec) -> None:
    """What megatron-core 0.19 refuses when the ranks build or first train ``spec`` in each role's layout, beyond
    the sizes of :func:`~megarl.models.megatron.check_layout` (checked by :func:`validate_for_model`), so that
    ``megarl train --check`` refuses it too:

    * an MoE model trained with ``tp > 1`` needs sequence parallelism (``MoELayer.forward`` raises in training
      without it); the reference, forward only, does not;
    * a top-1 router whose weights are renormalised over the top-k (``norm_topk_prob``, Mixtral) has no
      megatron form (``TransformerConfig`` asks for ``moe_router_pre_softmax`` with top-1, which weighs the expert
      by its softmax probability instead of 1: another model);
    * Gemma 3 and Qwen3.5 run on the local layer spec (:mod:`megarl.models.gemma3`, :mod:`megarl.models.qwen3_5`),
      not Transformer Engine's;
    * LoRA on an MoE model runs on the local layer spec (:func:`megarl.models.lora.adapt_layer_spec`), and
      adapters on its experts (``actor.lora.experts``; a dense model has none) on the sequential experts;
    * the grouped experts (``kernels.moe_experts="grouped"`` on the local spec) need a hidden size and
      ``moe_ffn_hidden_size`` whose rows torch's ``grouped_mm`` takes
      (:func:`megarl.kernels.grouped_experts.misaligned_sizes`);
    * then the role's ``TransformerConfig`` itself is built (:func:`~megarl.models.megatron.transformer_config`,
      no process group, no weight), so any other refusal of its ``__post_init__`` is reported here, naming the
      role's parallel field.

    Raises:
        ConfigError: naming the field (``{role}.parallel.sequence_parallel``, ``model.path``,
            ``actor.kernels.transformer_engine``, ``actor.kernels.moe_experts``, ``critic.kernels.moe_experts``,
            ``critic.kernels.transformer_engine``, ``{role}.parallel``) and the fix.
    """
    from megarl.kernels.grouped_experts import misaligned_sizes
    from megarl.models.checkpoint import DTYPES
    from megarl.models.megatron import transformer_config

    if spec.is_moe and spec.moe_top_k == 1 and spec.moe_norm_topk_prob:
        raise ConfigError(f"model.path: {cfg.model.path} routes each token to its top-1 expert with the weights "
                          "renormalised over the top-k (norm_topk_prob; weight 1), which megatron-core cannot "
                          "build (it needs moe_router_pre_softmax with top-1: the softmax probability as the weight); "
                          "use a model with num_experts_per_tok >= 2 or norm_topk_prob=false")
    if cfg.actor.lora.experts:
        require(spec.is_moe, "actor.lora.experts", f"{cfg.model.path} is a dense {spec.family} model: it has no "
                "experts to adapt; set actor.lora.experts=false (actor.lora.target_modules adapts its layers)")
        require(cfg.actor.kernels.moe_experts != "grouped" or cfg.actor.kernels.transformer_engine,
                "actor.lora.experts", "adapters on the experts need one linear layer per expert; set "
                "actor.kernels.moe_experts=sequential or actor.lora.experts=false")
    if spec.is_moe and cfg.actor.lora.enabled and cfg.actor.kernels.transformer_engine:
        raise ConfigError("actor.kernels.transformer_engine: LoRA on a mixture-of-experts model runs on the local "
                          "layer spec (TE's grouped and shared experts have no adapters); set "
                          "actor.kernels.transformer_engine=false or actor.lora.rank=0")
    for role, field_name, p, rc, trained in _megatron_roles(cfg):
        if trained and spec.is_moe and p.tp > 1 and not p.sequence_parallel:
            raise ConfigError(f"{field_name}.sequence_parallel: megatron-core's MoE layer refuses to train with "
                              f"tp={p.tp} without sequence parallelism ({spec.family} has {spec.num_experts} "
                              f"experts); set {field_name}.sequence_parallel=true or tp=1")
        section = "critic" if role == "critic" else "actor"  # the reference is built as the actor
        if FAMILIES[spec.family].gemma and rc.kernels.transformer_engine:
            raise ConfigError(f"{section}.kernels.transformer_engine: Gemma 3 runs on the local layer spec (its "
                              "(1 + weight) and post-attention/post-MLP norms are megarl modules, not Transformer "
                              f"Engine's); set {section}.kernels.transformer_engine=false")
        if FAMILIES[spec.family].gpt_oss:
            _check_gpt_oss(cfg, section, field_name, p, rc)
        if spec.gdn is not None and rc.kernels.transformer_engine:
            raise ConfigError(f"{section}.kernels.transformer_engine: Qwen3.5 runs on the local layer spec (megarl "
                              f"does not lay out TE's fused norms); set {section}.kernels.transformer_engine=false")
        grouped = spec.is_moe and rc.kernels.moe_experts == "grouped" and not rc.kernels.transformer_engine
        misaligned = grouped and misaligned_sizes(spec.hidden_size, spec.moe_ffn_hidden_size, DTYPES[cfg.model.dtype])
        if misaligned:
            raise ConfigError(f"{section}.kernels.moe_experts: the grouped experts' grouped_mm needs rows of a "
                              f"multiple of 16 bytes, and in {cfg.model.dtype} {spec.family}'s "
                              + ", ".join(f"{n}={getattr(spec, n)} is not a multiple of {m}"
                                          for n, m in misaligned.items())
                              + f"; set {section}.kernels.moe_experts=sequential")
        ep = cfg.actor.parallel.ep
        layout = ParallelLayout(tp=p.tp, pp=p.pp, dp=ep, ep=ep, cp=p.cp, vpp=p.vpp)
        try:
            transformer_config(spec, layout, params_dtype=DTYPES[cfg.model.dtype],
                               sequence_parallel=rc.parallel.sequence_parallel, recompute=rc.recompute,
                               init_weights=False, grouped_gemm=rc.kernels.transformer_engine and spec.is_moe,
                               moe_dispatcher=rc.moe.token_dispatcher)
        except (ValueError, AssertionError, SpecError) as e:
            raise ConfigError(f"{field_name}: megatron-core refuses the {role}'s model config on tp={p.tp}, "
                              f"pp={p.pp}, cp={p.cp}, vpp={p.vpp}, ep={ep}: {e}") from None


def _check_gpt_oss(cfg: Config, section: str, field_name: str, p, rc) -> None:
    """Refuse what a gpt-oss model cannot run with (:func:`megarl.models.megatron.layer_spec`'s kernels): its
    attention sinks are in megatron's local attention only (no sdpa, hence no packed sequences, and no CP), its biased
    experts in ``SequentialMLP`` only, on the local layer spec; the transformers rollout engine cannot take its
    experts from the reshard (:func:`megarl.models.layout.hf_layout`).

    Raises:
        ConfigError: naming the field and the value to use.
    """
    why = "gpt-oss's attention sinks run in megatron's local attention only (torch's SDPA has no sink)"
    require(not rc.kernels.transformer_engine, f"{section}.kernels.transformer_engine", "gpt-oss runs on the local "
            "layer spec (its sinks and expert biases are laid out for megatron's local modules); set it to false")
    require(rc.kernels.attention == "local", f"{section}.kernels.attention", f"{why}; set it to local")
    require(rc.kernels.moe_experts == "sequential", f"{section}.kernels.moe_experts",
            "gpt-oss's experts have biases, which the grouped experts lack; set it to sequential")
    require(p.cp == 1, f"{field_name}.cp", f"{why}, which has no context parallelism; set cp=1")
    require(cfg.rollout.engine != "hf", "rollout.engine", "gpt-oss's transformers model holds its experts "
            "transposed and interleaved, which the reshard does not write; use rollout.engine=vllm")


def preparable(name: str | None, path: str | Path) -> bool:
    """Whether ``data.prepare=name`` makes the missing file ``path``: the dataset's ``train.parquet`` or
    ``test.parquet`` in a folder named for it (the defaults ``data/arithmetic/``, ``data/gsm8k/``). Any other
    missing path is a typo or the user's own data, and is never written."""
    p = Path(path)
    return name is not None and p.name in ("train.parquet", "test.parquet") and name in p.parent.name.lower()


def check_files(cfg: Config, field: str, files: list[str], alternative: str = "") -> None:
    """Raises ConfigError naming ``field`` when one of its ``files`` is missing and ``data.prepare`` cannot
    make it (:func:`preparable`); ``alternative`` ends the message (another way out, e.g.
    `` (or validation.enabled=false)``)."""
    missing = [f for f in files if not Path(f).is_file()]
    name = cfg.data.prepare
    if missing and name is None:
        raise ConfigError(f"{field}: {missing} do not exist; create them or set data.prepare to one of "
                          f"{list(PREPARED)}{alternative}")
    foreign = [f for f in missing if not preparable(name, f)]
    if foreign:
        raise ConfigError(f"{field}: {foreign} do not exist; check the path (data.prepare={name} writes only "
                          f"its own train.parquet and test.parquet, into a folder named for it such as "
                          f"data/{name}/){alternative}")


def prepare_files(cfg: Config, files: list[str]) -> None:
    """Write the missing ``files`` that ``data.prepare`` makes (:func:`preparable`; both splits into the file's
    folder): GSM8K from ``data.gsm8k_source``, the arithmetic task from its generator, beside the folder's other
    files (kept: :mod:`megarl.output_folder`). One process only: the caller keeps others waiting.

    Raises:
        DataError: the GSM8K source cannot be read.
        OutputFolderError: the folder holds a ``train.parquet`` or ``test.parquet`` that the preparation did not
            write (never replaced), or is part of a training run.
    """
    name = cfg.data.prepare
    if name == "reasoning_gym":  # the tasks exist, and files already there were made from these settings
        from megarl.environments.reasoning_gym import check_prepared

        check_prepared([f for f in files if preparable(name, f)], cfg.data.prepare_kwargs)
    folders = dict.fromkeys(Path(f).parent for f in files if not Path(f).is_file() and preparable(name, f))
    if not folders:
        return
    if name == "reasoning_gym":
        from megarl.environments.reasoning_gym import prepare_reasoning_gym

        write = functools.partial(prepare_reasoning_gym, kwargs=cfg.data.prepare_kwargs)
        what = "reasoning-gym's tasks"
    elif name == "verifiers":
        from megarl.environments.verifiers import prepare_verifiers

        write = functools.partial(prepare_verifiers, kwargs=cfg.data.prepare_kwargs)
        what = f"verifiers taskset {cfg.data.prepare_kwargs.get('taskset')!r}"
    elif name == "arithmetic":
        from megarl.data.arithmetic import prepare_arithmetic as write

        what = "the arithmetic task"
    elif name == "calculator":
        from megarl.data.arithmetic import prepare_calculator as write

        what = "the calculator task"
    else:
        from megarl.data.gsm8k import prepare_gsm8k

        src = cfg.data.gsm8k_source
        if src == "auto":
            local = [p for p in (Path("../shared/data/gsm8k"), Path(__file__).parents[3] / "shared/data/gsm8k")
                     if (p / "train.jsonl").is_file()]
            src = str(local[0]) if local else "hub"
        write, what = functools.partial(prepare_gsm8k, src), f"GSM8K from {src}"
    for folder in folders:
        log.info("writing %s into %s", what, folder)
        write(folder, overwrite=True)


def read_prompts(cfg: Config, tokenizer, files: list[str], field: str = "data.train_files") -> PromptDataset:
    """The tokenised, templated, length-filtered prompts of ``files`` (``field`` of the config) as ``data``
    says (prompt and answer fields, template, ``max_prompt_length``).

    Raises:
        ConfigError: naming ``field``, the file, the row and the fix (a missing field, an empty prompt, one
            of no tokens, none short enough).
    """
    template = PromptTemplate(system_prompt=cfg.data.system_prompt, instruction=cfg.data.instruction,
                              use_chat_template=cfg.data.use_chat_template)
    try:
        rows = [row for f in files for row in read_rows(f)]
        return PromptDataset(rows, tokenizer, prompt_key=cfg.data.prompt_key, ground_truth_key=cfg.data.answer_key,
                             template=template, max_prompt_length=cfg.data.max_prompt_length,
                             source=",".join(files))
    except DataError as e:
        raise ConfigError(f"{field}: {e}") from None


def check_data(cfg: Config, tokenizer, *, prepare: bool = True) -> None:
    """The train files and, when validation is on, ``validation.files``: present or made by ``data.prepare``
    (:func:`check_data_files`; made now), then every row is read, templated and tokenised as the ranks will
    (:func:`read_prompts`), and the reward function is called on the first training rows with empty responses (a ground truth it
    cannot read fails here). Without ``prepare`` (a config checked on another machine than the one it runs on),
    files that ``data.prepare`` would make are left to the run (a verifiers taskset is loaded and its rows
    counted, writing nothing), and a field whose files are not all here is not read.

    Raises:
        ConfigError: naming the field (:func:`check_files`, :func:`read_prompts`, ``reward.fn``).
        DataError: the GSM8K source cannot be read.
    """
    check_data_files(cfg)
    fields = [("data.train_files", cfg.data.train_files)]
    if cfg.validation.enabled:
        fields.append(("validation.files", cfg.validation.files))
    if prepare:
        prepare_files(cfg, [f for _, files in fields for f in files])
    elif cfg.data.prepare == "verifiers" and any(not Path(f).is_file() for _, files in fields for f in files):
        from megarl.environments.verifiers import verifiers_rows

        verifiers_rows(cfg.data.prepare_kwargs)  # the taskset loads and has the rows asked for; nothing written
    datasets = {field: read_prompts(cfg, tokenizer, files, field) for field, files in fields
                if all(Path(f).is_file() for f in files)}
    train = datasets.get("data.train_files")
    if train is not None:
        check_one_batch(cfg, train, datasets.get("validation.files"))
    if train is None or inspect.isclass(find_reward(cfg.reward.fn)):
        return  # a reward model: built on the ranks
    first = range(min(4, len(train)))
    try:
        load_reward_fn(cfg.reward.fn, cfg.reward.kwargs)([train.raw_prompts[k] for k in first], [""] * len(first),
                                                         [train.ground_truths[k] for k in first])
    except Exception as e:  # noqa: BLE001 (any failure of the user's function, named with its data)
        raise ConfigError(f"reward.fn: {cfg.reward.fn!r} failed on the first rows of data.train_files "
                          f"({type(e).__name__}: {e}); check data.answer_key and reward.kwargs") from None


def check_one_batch(cfg: Config, train: PromptDataset, validation: PromptDataset | None) -> None:
    """The training prompts, less those the validation holds out (:meth:`~megarl.trainer.validation.Validation.
    hold_out`: its prompts of the same text), fill one step's batch of ``data.prompts_per_step`` (the run's prompt
    loader drops an incomplete batch, :class:`~megarl.data.loader.PromptLoader`).

    Raises:
        ConfigError: naming ``data.prompts_per_step``, the files and the counts.
    """
    from megarl.trainer.validation import select_prompts

    held = set()
    if validation is not None:
        held = set(select_prompts(validation, cfg.validation.num_prompts, shuffle=cfg.validation.shuffle,
                                  seed=cfg.run.seed).raw_prompt)
    left = sum(p not in held for p in train.raw_prompts)
    fix = ("give validation.files of other prompts, or validation.enabled=false" if left == 0 < len(train)
           else "lower data.prompts_per_step or add data")
    if left < cfg.data.prompts_per_step:
        why = (f" ({len(train) - left} of its {len(train)} are validation prompts, held out)" if left < len(train)
               else "")
        raise ConfigError(f"data.prompts_per_step: data.train_files {train.source} holds {left} training prompts"
                          f"{why} that fit data.max_prompt_length={cfg.data.max_prompt_length}, fewer than one "
                          f"step's batch of {cfg.data.prompts_per_step}; " + fix)


def check_reward(cfg: Config) -> None:
    """Find ``reward.fn`` and check ``reward.kwargs`` against its parameters (a function's, or a class's
    constructor's; the class is built on the ranks), and a reward model's folder's weight files
    (:func:`~megarl.models.hf_io.check_weight_files`; transformers, which loads them on the ranks, names no file).

    Raises:
        ConfigError: naming ``reward.fn`` (unknown name, unimportable path) or ``reward.kwargs`` (parameters
            it does not take, a value of the wrong type), or ``reward.kwargs.model`` (a damaged weight file).
    """
    try:
        fn = find_reward(cfg.reward.fn)
    except RewardError as e:
        raise ConfigError(f"reward.fn: {e}") from None
    try:
        check_reward_params(cfg.reward.fn, fn, cfg.reward.kwargs)
    except RewardError as e:
        raise ConfigError(f"reward.kwargs: {e}") from None
    model = (cfg.reward.kwargs or {}).get("model")
    if fn is RewardModel and isinstance(model, str) and Path(model).is_dir():
        try:
            check_weight_files(model)
        except (FileNotFoundError, FileFormatError) as e:
            raise ConfigError(f"reward.kwargs.model: {e}") from None


def check_data_files(cfg: Config) -> None:
    """:func:`check_files` of ``data.train_files`` and, when validation is on, ``validation.files``; with
    ``data.prepare=reasoning_gym``, its ``data.prepare_kwargs`` (tasks reasoning-gym has)."""
    check_files(cfg, "data.train_files", cfg.data.train_files)
    if cfg.data.prepare == "reasoning_gym":  # the task names, weights and configs, against reasoning-gym
        from megarl.environments.reasoning_gym import normalise_kwargs

        normalise_kwargs(cfg.data.prepare_kwargs)
    if cfg.validation.enabled:
        check_files(cfg, "validation.files", cfg.validation.files, " (or validation.enabled=false)")


def check_tokenizer(cfg: Config, model_tokenizer: str | None):
    """The tokenizer of :func:`tokenizer_source`, loaded.

    Raises:
        ConfigError: naming ``model.tokenizer``, the path and what a tokenizer folder needs.
    """
    try:
        return load_tokenizer(tokenizer_source(cfg, model_tokenizer))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"model.tokenizer: {e}") from None


def check_this_machine(cfg: Config) -> None:
    """What this machine must have for a job of its own ranks: vLLM rollouts need vLLM and a GPU.

    With ``rollout.exact``, a GPU that vLLM 0.24's batch-invariant mode supports: compute capability 8.0 and up
    (``vllm/model_executor/layers/batch_invariant.py``: Triton matmuls on SM80, cuBLASLt without split-K on SM90+).

    Raises:
        ConfigError: naming ``rollout.engine`` (or ``rollout.exact``) and the fix.
    """
    if cfg.rollout.engine == "vllm" and not torch.cuda.is_available():
        raise ConfigError("rollout.engine: vllm generates on a GPU and this machine has none; use "
                          "rollout.engine=hf on a CPU")
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine: vllm is not installed (MEGARL_EXTRAS=gpu ./build.sh installs it)")
    capability = torch.cuda.get_device_capability() if cfg.rollout.engine == "vllm" and cfg.rollout.exact else None
    if capability is not None and capability < MIN_EXACT_CAPABILITY:
        raise ConfigError(f"rollout.exact: vLLM's batch-invariant mode needs an NVIDIA GPU of compute capability "
                          f"{'.'.join(map(str, MIN_EXACT_CAPABILITY))} or newer (A100, H100, H200, B200), this one "
                          f"is {'.'.join(map(str, capability))}; use such a GPU or rollout.exact=false")


def preflight(cfg: Config, world_size: int, *, this_machine: bool = True) -> ModelSpec:
    """Every check that needs no process group or model, made by the process that starts a job's ranks on this
    machine: :func:`~megarl.parallel.placement.validate_for_world`, the model (:func:`validate_for_model`),
    the reward function and its parameters, the distillation's teacher
    (:func:`~megarl.workers.teacher.check_teacher`), with ``this_machine`` what this machine must have (``--check``
    leaves it out: a GPU config checked on a CPU machine), then the data (:func:`check_data`: prepared when
    missing, every row read and tokenised) and the multi-turn agent's tools, parser and environment
    (:func:`~megarl.trainer.episodes.build_agent`). Returns the model's spec.

    Raises:
        ConfigError: naming the field.
    """
    validate_for_world(cfg, world_size)
    spec, model_tokenizer = _model_source(cfg)
    validate_for_model(cfg, spec)
    check_reward(cfg)
    if this_machine:
        check_this_machine(cfg)
    check_data_files(cfg)
    tokenizer = check_tokenizer(cfg, model_tokenizer)
    check_teacher(cfg, tokenizer)  # on-policy distillation's: its tokenizer, layout and context
    check_data(cfg, tokenizer, prepare=this_machine)
    if cfg.rollout.multi_turn.enabled:  # tools found, the parser fits the chat template, the environment builds
        from megarl.trainer.episodes import build_agent

        build_agent(cfg, tokenizer)
    return spec
