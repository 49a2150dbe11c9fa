"""Megatron-core actor and critic builders for a :class:`~megarl.models.spec.ModelSpec` on a TP x PP mesh.

The actor is megatron-core's ``GPTModel``; the critic is the same trunk whose output layer is a scalar
:class:`ValueHead`. Both use megatron-core's local layer spec (with the ``kernels/`` attention), or Transformer
Engine's (``use_te=True``: fused LayerNorm + GEMM, TE's attention, FP8, grouped expert GEMMs; GPU only, never
picked implicitly). ``parallel_state`` must already be initialised
(:func:`megarl.parallel.mesh.initialize_model_parallel`).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
import torch.nn.functional as F

from megarl.config import MOE_DISPATCHERS, MOE_EXPERTS
from megarl.models.lora import LoRASpec, adapt_layer_spec, freeze_base
from megarl.models.spec import FAMILIES, ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout

DEFAULT_VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padded vocab: the smallest multiple of ``lcm(divisible_by, tp)`` that holds ``vocab_size``.

    Megatron-LM pads to a multiple of ``divisible_by * tp``; padding to the lcm instead keeps the padded size
    the same for every power-of-two TP up to ``divisible_by``, so a distributed checkpoint saved at one TP
    loads at another. Padded rows are zero and their logits are masked out of log-probs.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def check_layout(spec: ModelSpec, layout: ParallelLayout) -> None:
    """Check that megatron-core can shard ``spec`` on ``layout``.

    Raises:
        SpecError: naming the model size that the TP, PP or PP x VPP size does not divide, and the sizes that
            would.
    """
    fitting_tp = [t for t in range(1, spec.num_kv_heads + 1)
                  if spec.num_kv_heads % t == 0 and spec.num_attention_heads % t == 0
                  and spec.ffn_hidden_size % t == 0]
    if spec.num_attention_heads % layout.tp:
        raise SpecError(f"tp={layout.tp} does not divide num_attention_heads={spec.num_attention_heads}; "
                        f"TP sizes that fit this model: {fitting_tp}")
    if spec.num_kv_heads % layout.tp:
        raise SpecError(f"tp={layout.tp} does not divide the query groups num_kv_heads={spec.num_kv_heads} "
                        f"(megatron-core shards whole KV heads); TP sizes that fit this model: {fitting_tp}")
    dense = not spec.is_moe or (spec.deepseek_moe is not None and spec.deepseek_moe.first_k_dense > 0)
    if dense and spec.ffn_hidden_size % layout.tp:  # DeepSeek-V3 and GLM-4.5: their dense first layers
        raise SpecError(f"tp={layout.tp} does not divide ffn_hidden_size={spec.ffn_hidden_size} (intermediate_size)")
    if spec.shared_expert_ffn_hidden_size % layout.tp:
        raise SpecError(f"tp={layout.tp} does not divide the shared expert's shared_expert_intermediate_size="
                        f"{spec.shared_expert_ffn_hidden_size}")
    if layout.ep > 1 and not spec.is_moe:
        raise SpecError(f"ep={layout.ep}: expert parallelism needs a mixture-of-experts model; a {spec.family} "
                        "model has no experts (set ep=1)")
    if spec.is_moe and spec.num_experts % layout.ep:
        raise SpecError(f"ep={layout.ep} does not divide num_experts={spec.num_experts}; EP sizes that fit: "
                        f"{[e for e in range(1, spec.num_experts + 1) if spec.num_experts % e == 0]}")
    if spec.mla is not None:
        from megarl.models import deepseek

        deepseek.check_layout(spec, layout.tp, layout.cp)
    if spec.gdn is not None:
        from megarl.models import qwen3_5

        qwen3_5.check_layout(spec, layout)
    if layout.cp > 1 and spec.is_moe:
        raise SpecError(f"cp={layout.cp}: context parallelism runs dense models only; a {spec.family} "
                        "mixture-of-experts model needs cp=1")
    if spec.num_layers % layout.pp:
        raise SpecError(f"pp={layout.pp} does not divide num_layers={spec.num_layers}; PP sizes that fit: "
                        f"{[p for p in range(1, spec.num_layers + 1) if spec.num_layers % p == 0]}")
    if spec.num_layers % (layout.pp * layout.vpp):
        raise SpecError(f"pp={layout.pp} x vpp={layout.vpp} virtual pipeline stages do not divide num_layers="
                        f"{spec.num_layers}; vpp sizes that fit pp={layout.pp}: "
                        f"{[v for v in range(1, spec.num_layers + 1) if spec.num_layers % (layout.pp * v) == 0]}")


def have_transformer_engine() -> bool:
    """True where Transformer Engine imports (GPU machines with TE installed)."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE) and torch.cuda.is_available()


def transformer_config(spec: ModelSpec, layout: ParallelLayout, *, params_dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, recompute: bool = False, init_weights: bool = True,
                       fp8: str | None = None, grouped_gemm: bool = False, moe_dispatcher: str = "auto"):
    """The megatron-core ``TransformerConfig`` of ``spec`` on ``layout``.

    On a machine without a GPU it sets what megatron needs there: CPU initialisation, every fusion off and no
    synchronisation after p2p. Dropout is off (RL fine-tuning).

    Args:
        params_dtype: dtype of the parameters (torch.float32 on CPU; torch.bfloat16 on GPU).
        sequence_parallel: split LayerNorm/dropout activations over TP (needs tp > 1).
        recompute: full activation recomputation of every layer.
        init_weights: run megatron's random init (off when weights are loaded right after).
        fp8: megatron's FP8 training (``"hybrid"``: E4M3 forward, E5M2 gradients; ``"e4m3"``), with the
            per-tensor current-scaling recipe; needs the Transformer Engine layer spec. None: off.
        grouped_gemm: an MoE layer's experts as grouped GEMMs (TE's ``TEGroupedMLP``; TE spec only).
        moe_dispatcher: an MoE layer's token dispatcher (:func:`moe_config_kwargs`).

    Raises:
        SpecError: from :func:`check_layout`, or an unknown ``moe_dispatcher``.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_layout(spec, layout)
    on_gpu = torch.cuda.is_available()
    kwargs = {}
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.sliding_window is not None:  # HF's window of w tokens: the w - 1 before a token, and itself
        kwargs.update(window_size=(spec.sliding_window - 1, 0))
    if spec.is_moe:
        kwargs.update(moe_config_kwargs(spec, layout.ep, grouped_gemm, moe_dispatcher))
    if FAMILIES[spec.family].gemma:
        from megarl.models import gemma3

        kwargs.update(gemma3.config_kwargs(spec))
    if FAMILIES[spec.family].gpt_oss:
        from megarl.models import gpt_oss_layers

        kwargs.update(gpt_oss_layers.config_kwargs(spec))
    if spec.mla is not None:
        from megarl.models import deepseek

        kwargs.update(deepseek.config_kwargs(spec))
    if spec.deepseek_moe is not None:
        from megarl.models import deepseek_moe_layers

        kwargs.update(deepseek_moe_layers.config_kwargs(spec))
    if spec.gdn is not None:
        from megarl.models import qwen3_5

        kwargs.update(qwen3_5.config_kwargs(spec))
    if fp8 is not None:
        kwargs.update(fp8=fp8, fp8_recipe="tensorwise")
    if layout.vpp > 1:
        # Megatron-LM's p2p for the interleaved schedule (overlap_p2p_comm, hence no batch_p2p_comm): its
        # unbatched ops split a 2-rank pipeline's two directions over two process groups. Batched, the forward
        # activation and the backward gradient that both ranks of PP=2 exchange in one step have one peer and one
        # shape and may be swapped (measured on gloo: wrong activations in the 1F1B steady state).
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    return (MLATransformerConfig if spec.mla is not None else TransformerConfig)(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=kwargs.pop("activation_func", F.silu),
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        add_bias_linear=kwargs.pop("add_bias_linear", False),
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=kwargs.pop("qk_layernorm", spec.qk_norm),
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        sequence_parallel=sequence_parallel and layout.tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=init_weights,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        batch_p2p_sync=on_gpu,
        **kwargs,
    )


def moe_config_kwargs(spec: ModelSpec, ep: int = 1, grouped_gemm: bool = False, dispatcher: str = "auto") -> dict:
    """The ``TransformerConfig`` fields of an MoE spec: megatron-core's ``MoELayer`` computing what transformers
    computes.

    The router scores experts with a softmax. HF's ``norm_topk_prob`` (Mixtral: always) renormalises the top-k
    of the softmax over all experts, which equals megatron's softmax over the top-k logits
    (``moe_router_pre_softmax=False``); without it, the top-k of the full softmax are used as they are
    (``moe_router_pre_softmax=True``). No expert capacity (no token dropped, as HF computes), expert TP = 1,
    the load-balancing loss ``aux_loss`` with the config's ``router_aux_loss_coef`` (none when it is 0) and the
    z-loss with its ``router_z_loss_coef`` (none when 0), both over the mini-batch's real tokens
    (:mod:`megarl.models.moe_router`), Qwen2-MoE's shared expert with its sigmoid gate; the experts one GEMM
    each, or grouped (``grouped_gemm``, TE spec).

    Args:
        ep: the expert-parallel size.
        dispatcher: megatron's token dispatcher: "allgather" (every EP rank gathers all the EP group's tokens
            and keeps its experts'), "alltoall" (each token goes only to the ranks of its experts: an uneven
            ``all_to_all_single``, which gloo runs too; on the CPU its split sizes reach it as host arrays and its
            copy stream is a no-op through :mod:`megarl.parallel.megatron_cpu`), or "auto": "alltoall" at
            ``ep > 1``, "allgather" at ``ep = 1`` (one EP rank holds every expert: neither exchanges anything,
            and all-gather skips all-to-all's split bookkeeping). Both give the same outputs and gradients
            (tests/test_models_moe.py) and take the router's ``routing_map`` and probabilities as
            :class:`~megarl.models.moe_router.GlobalBatchRouter` and router replay made them.

    Raises:
        SpecError: an unknown ``dispatcher``.
    """
    if dispatcher not in MOE_DISPATCHERS:
        raise SpecError(f"dispatcher must be one of {MOE_DISPATCHERS}, got {dispatcher!r}")
    if dispatcher == "auto":
        dispatcher = "alltoall" if ep > 1 else "allgather"
    kwargs = dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_top_k,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=spec.moe_aux_loss_coef,
        moe_z_loss_coeff=spec.moe_z_loss_coef or None,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped_gemm,
    )
    if spec.shared_expert_ffn_hidden_size:
        kwargs.update(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=True, moe_shared_expert_overlap=False)
    return kwargs


def conversion_moe_experts(spec: ModelSpec) -> str:
    """The routed experts a conversion or an export builds (their checkpoints are alike): "grouped", or
    "sequential" for gpt-oss, whose biased experts the grouped ones lack (:func:`layer_spec`)."""
    return "sequential" if FAMILIES[spec.family].gpt_oss else "grouped"


def layer_spec(use_te: bool = False, attention: str = "local", spec: ModelSpec | None = None,
               lora: LoRASpec | None = None, moe_experts: str = "grouped"):
    """megatron-core's GPT layer spec: the local one, or Transformer Engine's (``use_te``), with LoRA adapters on
    ``lora``'s target layers (:func:`megarl.models.lora.adapt_layer_spec`).

    Args:
        attention: the local spec's core attention: "local" (megatron's ``DotProductAttention``) or "sdpa"
            (:class:`megarl.kernels.attention.SDPAttention`, torch's fused attention). The TE spec keeps its own.
        spec: the model; an MoE model gets megatron's ``MoELayer`` with the
            :class:`~megarl.models.moe_router.GlobalBatchRouter`, and experts as ``moe_experts`` says on the local
            spec, ``TEGroupedMLP`` on TE's (the local experts' GEMMs grouped); a Qwen3 model RMSNorm of queries
            and keys.
        moe_experts: the local spec's routed experts: "grouped" (:class:`megarl.kernels.grouped_experts.GroupedExperts`,
            two grouped GEMMs) or "sequential" (megatron's ``SequentialMLP``, one GEMM per local expert).

    Raises:
        SpecError: an unknown ``attention`` or ``moe_experts``, ``use_te=True`` where Transformer Engine does not
            import (or there is no GPU), or LoRA on what it does not adapt
            (:func:`~megarl.models.lora.adapt_layer_spec`; the experts: "sequential" only).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if attention not in ("local", "sdpa"):
        raise SpecError(f"attention must be 'local' or 'sdpa', got {attention!r}")
    if moe_experts not in MOE_EXPERTS:
        raise SpecError(f"moe_experts must be one of {MOE_EXPERTS}, got {moe_experts!r}")
    if use_te and not have_transformer_engine():
        raise SpecError("use_te=True: Transformer Engine's layer spec needs transformer_engine.pytorch importable "
                        "and a GPU (perf/gpu_te.sh builds it); set actor.kernels.transformer_engine=false for the "
                        "local spec")
    moe = dict(num_experts=spec.num_experts or None, qk_layernorm=spec.qk_norm) if spec is not None else {}
    if spec is not None and spec.mla is not None:  # the a-projection norms are megatron's q/kv_layernorm
        moe.update(qk_layernorm=True, multi_latent_attention=True)
        if use_te or lora is not None:
            raise SpecError("DeepSeek-V3 runs on the local layer spec without LoRA (megarl does not yet lay out TE's "
                            "fused MLA norms or adapters on MLA's projections); set actor.kernels.transformer_engine="
                            "false and actor.lora.enabled=false")
    if spec is not None and spec.glm is not None and use_te:
        raise SpecError("GLM-4.5 runs on the local layer spec (megarl does not yet lay out TE's fused norms beside its "
                        "dense first layers); set actor.kernels.transformer_engine=false")
    gemma = spec is not None and FAMILIES[spec.family].gemma
    if (use_te or lora is not None) and spec is not None and spec.gdn is not None:
        raise SpecError("Qwen3.5 runs on the local layer spec without LoRA (megarl does not lay out TE's fused norms "
                        "or adapters on the gated DeltaNet's fused in_proj); set "
                        "actor.kernels.transformer_engine=false and actor.lora.enabled=false")
    if use_te and gemma:
        raise SpecError("Gemma 3 runs on the local layer spec (its (1 + weight) and post-attention/post-MLP norms are "
                        "megarl modules, not Transformer Engine's); set actor.kernels.transformer_engine=false")
    if spec is not None and FAMILIES[spec.family].gpt_oss:
        _check_gpt_oss_kernels(use_te, attention, moe_experts)
    if use_te:
        layer = get_gpt_layer_with_transformer_engine_spec(**moe, moe_grouped_gemm=bool(moe.get("num_experts")))
    else:
        layer = get_gpt_layer_local_spec(normalization="RMSNorm", **moe)
        if attention == "sdpa":
            from megarl.kernels.attention import SDPAttention

            layer.submodules.self_attention.submodules.core_attention = SDPAttention
        if gemma:
            from megarl.models import gemma3

            gemma3.adapt_layer_spec(layer, spec)
        if spec is not None and FAMILIES[spec.family].gpt_oss:
            from megarl.models import gpt_oss_layers

            gpt_oss_layers.adapt_layer_spec(layer)
        if moe.get("multi_latent_attention"):
            from megarl.models import deepseek

            deepseek.adapt_layer_spec(layer, spec)
        if spec is not None and spec.gdn is not None:
            from megarl.models import qwen3_5

            qwen3_5.adapt_layer_spec(layer)
    if moe.get("num_experts"):
        from megarl.models.moe_router import GlobalBatchRouter

        mlp = layer.submodules.mlp  # megatron-core 0.19: a partial of MoELayer (a ModuleSpec before)
        moe_subs = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
        moe_subs.router = GlobalBatchRouter
        if not use_te and moe_experts == "grouped":
            if lora is not None and lora.experts:
                raise SpecError("LoRA on the experts (lora.experts) needs one linear layer per expert; set "
                                "actor.kernels.moe_experts=sequential")
            from megarl.kernels.grouped_experts import GroupedExperts

            moe_subs.experts = GroupedExperts
    if lora is not None:
        adapt_layer_spec(layer, lora, use_te=use_te)
    return layer


def _check_gpt_oss_kernels(use_te: bool, attention: str, moe_experts: str) -> None:
    """Refuse the kernels a gpt-oss model cannot run on (:mod:`megarl.models.gpt_oss`): its attention sinks are
    megatron's local ``DotProductAttention``'s (``softmax_offset``; torch's SDPA has no sink, so neither have
    :class:`~megarl.kernels.attention.SDPAttention`, packed sequences nor CP), its biased experts
    ``SequentialMLP``'s (the grouped experts have no bias); Transformer Engine's layout of them is not described.

    Raises:
        SpecError: naming the setting and the value to use.
    """
    if use_te:
        raise SpecError("gpt-oss runs on the local layer spec (its expert biases and sinks are laid out for megatron's "
                        "SequentialMLP and DotProductAttention); set actor.kernels.transformer_engine=false")
    if attention != "local":
        raise SpecError(f"attention={attention!r}: gpt-oss's attention sinks run in megatron's local attention only "
                        "(torch's scaled_dot_product_attention has no sink; so no packing and no CP); set "
                        "actor.kernels.attention=local")
    if moe_experts != "sequential":
        raise SpecError(f"moe_experts={moe_experts!r}: gpt-oss's experts have biases, which the grouped experts lack; "
                        "set actor.kernels.moe_experts=sequential")


class ValueHead(torch.nn.Module):
    """The critic's output layer: hidden state -> one scalar value per token.

    Replicated on every TP rank (its input is identical there). Called like megatron's output layer.

    Shapes:
        input: ``[s, b, hidden]`` (``[s/tp, b, hidden]`` under sequence parallel), params dtype.
        output: ``([s, b, 1], None)``.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        return F.linear(hidden_states, self.weight), None


def build_model(spec: ModelSpec, layout: ParallelLayout, role: Literal["actor", "critic"] = "actor", *,
                params_dtype: torch.dtype = torch.float32, use_te: bool = False,
                sequence_parallel: bool = False, recompute: bool = False, init_weights: bool = True,
                vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY, attention: str = "local",
                fp8: str | None = None, vp_stage: int | None = None, lora: LoRASpec | None = None,
                moe_experts: str = "grouped", moe_dispatcher: str = "auto"):
    """Build this rank's stage (or, with VPP, one model chunk) of the actor (``GPTModel``) or critic (same
    trunk + :class:`ValueHead`).

    The model's parameters are initialised randomly (megatron's init) unless ``init_weights=False``; load
    weights with :func:`megarl.models.checkpoint.load_weights`. ``attention`` picks the local spec's core
    attention (:func:`layer_spec`), ``use_te`` Transformer Engine's spec instead (recorded as the model's
    ``megarl_use_te``, which names its parameters in :mod:`megarl.models.layout_megatron`), ``moe_experts`` the
    local spec's routed experts (:func:`layer_spec`; recorded as ``megarl_moe_experts``, which names theirs),
    ``moe_dispatcher`` its token dispatcher (:func:`moe_config_kwargs`); ``fp8`` turns on FP8 training
    (:func:`transformer_config`; TE spec only). ``vp_stage``: the chunk ``c`` of this rank to build when
    ``layout.vpp > 1`` (virtual stage ``c * pp + pp_rank``, :meth:`~megarl.parallel.mesh.ParallelLayout.chunk_layers`):
    the embedding only on virtual stage 0, the output layer only on the last; :func:`build_model_chunks` builds
    them all. ``lora``: LoRA adapters on its target layers (:mod:`megarl.models.lora`; the actor only), every
    other parameter frozen (``requires_grad=False``), recorded as the model's ``megarl_lora``; the adapters are
    zero until :func:`megarl.models.weights.init_adapters` or a checkpoint fills them.

    Returns:
        A ``GPTModel`` for this rank's pipeline stage or chunk. Its forward takes ``input_ids [b, s]`` (int64) and
        ``position_ids [b, s]`` and returns, on the last stage, vocab-parallel logits
        ``[b, s, padded_vocab/tp]`` (actor) or values ``[b, s, 1]`` (critic), and elsewhere the hidden states.

    With ``layout.cp > 1`` each rank runs its CP share of every sequence (``input_ids [b, s / cp]``, split by
    :func:`megarl.kernels.context_parallel.split_for_cp_rank`; megatron's RoPE picks the global positions) and returns
    the outputs of those tokens; the local spec's attention must be "sdpa" (megatron's local attention has no
    CP; Transformer Engine's has its own).

    Raises:
        SpecError: the layout does not fit the model (:func:`check_layout`), an unknown role or
            ``moe_dispatcher``, ``use_te`` without
            TE, ``fp8`` without ``use_te``, CP with the local spec's "local" attention, or a ``vp_stage`` missing
            or outside ``[0, layout.vpp)`` with VPP (given without it).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if role not in ("actor", "critic"):
        raise SpecError(f"role must be 'actor' or 'critic', got {role!r}")
    if lora is not None and role != "actor":
        raise SpecError("LoRA adapters are built on the actor only (the critic trains every weight)")
    if fp8 is not None and not use_te:
        raise SpecError(f"fp8={fp8!r} needs the Transformer Engine layer spec (use_te=True, with TE installed)")
    if layout.cp > 1 and attention != "sdpa" and not use_te:
        raise SpecError(f"cp={layout.cp}: context parallelism on the local layer spec needs the 'sdpa' attention "
                        f"(set actor.kernels.attention=sdpa), got {attention!r}")
    if layout.vpp > 1 and vp_stage not in range(layout.vpp):
        raise SpecError(f"vp_stage must be a chunk in [0, {layout.vpp}) with vpp={layout.vpp}, got {vp_stage}")
    if layout.vpp == 1 and vp_stage is not None:
        raise SpecError(f"vp_stage={vp_stage} given without virtual pipeline stages (vpp=1)")
    config = transformer_config(spec, layout, params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute, init_weights=init_weights, fp8=fp8,
                                grouped_gemm=use_te and spec.is_moe, moe_dispatcher=moe_dispatcher)
    tied = spec.tie_word_embeddings and role == "actor"
    layers = layer_spec(use_te, attention, spec, lora, moe_experts)
    if FAMILIES[spec.family].gemma:
        from megarl.models import gemma3

        layers = gemma3.block_spec(layers, config, vp_stage)
    if spec.deepseek_moe is not None:
        from megarl.models import deepseek_moe_layers

        layers = deepseek_moe_layers.block_spec(layers, config, vp_stage, spec, lora)
    if spec.gdn is not None:
        from megarl.models import qwen3_5

        layers = qwen3_5.block_spec(layers, config, vp_stage, spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layers,
        vocab_size=padded_vocab_size(spec.vocab_size, layout.tp, vocab_divisible_by),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_percent=(spec.glm.partial_rotary_factor if spec.glm is not None  # GLM-4.5, Qwen3.5: partial RoPE
                        else spec.gdn.partial_rotary_factor if spec.gdn is not None else 1.0),
        rotary_base=spec.rope_theta,
        vp_stage=vp_stage,
    )
    if hasattr(model, "rotary_pos_emb"):
        _set_rope_frequencies(model.rotary_pos_emb, spec)
    if role == "critic" and model.post_process:
        model.output_layer = ValueHead(spec.hidden_size, params_dtype, config.sequence_parallel)
    _zero_vocab_padding(model, spec.vocab_size)
    _cast_parameters(model, params_dtype)
    if FAMILIES[spec.family].gemma:
        gemma3.scale_embeddings(model, spec.hidden_size)
    if FAMILIES[spec.family].gpt_oss:
        from megarl.models import gpt_oss_layers

        gpt_oss_layers.reorder_expert_outputs(model)
    if spec.deepseek_moe is not None:
        deepseek_moe_layers.freeze_expert_bias(model)
    model.megarl_spec = spec
    model.megarl_role = role
    model.megarl_use_te = use_te
    model.megarl_moe_experts = moe_experts
    model.megarl_lora = lora
    if lora is not None:
        _freeze_for_lora(model, recompute)
    return model


def _freeze_for_lora(model, recompute: bool) -> None:
    """Freeze everything but the adapters. With recomputation, the embedding's output is made to require a
    gradient: megatron's checkpointed layers get gradients only through inputs that require one, and the frozen
    embedding's output does not (the adapters inside would get none)."""
    freeze_base(model)
    if recompute and model.pre_process:
        model.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))


def build_model_chunks(spec: ModelSpec, layout: ParallelLayout, role: Literal["actor", "critic"] = "actor",
                       **kwargs) -> list:
    """This rank's model chunks: ``layout.vpp`` ``GPTModel`` s built by :func:`build_model` with ``vp_stage=c``
    (one model without VPP), as megatron's interleaved schedule takes them (Megatron-LM's ``get_model``).

    Args:
        kwargs: :func:`build_model`'s keyword arguments.

    Raises:
        SpecError: from :func:`build_model`.
    """
    return [build_model(spec, layout, role, vp_stage=c if layout.vpp > 1 else None, **kwargs)
            for c in range(layout.vpp)]


def _cast_parameters(model, dtype: torch.dtype) -> None:
    """Give every parameter ``dtype``. The local spec's torch RMSNorm ignores ``params_dtype`` and keeps fp32
    weights (Megatron-LM casts the whole model with its Float16Module); left so, a bf16 model mixes dtypes in
    one DDP buffer, which breaks megatron's optimizer checkpoints and the fused RMSNorm kernel. Buffers (RoPE
    frequencies) keep their dtype."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def _zero_vocab_padding(model, vocab_size: int) -> None:
    """Zero the rows of the padded vocab (beyond ``vocab_size``) held by this TP rank, so they carry no
    random init into checkpoints or logits."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") and p.shape[0] > 1:
            lo = rank * p.shape[0]
            if lo + p.shape[0] > vocab_size:
                with torch.no_grad():
                    p[max(0, vocab_size - lo):].zero_()


def _set_rope_frequencies(rotary, spec: ModelSpec) -> None:
    """Set megatron's RoPE inverse frequencies from transformers' own ``ROPE_INIT_FUNCTIONS`` for the spec's
    ``rope_type`` (default, linear, llama3), so positions match the HF model exactly. The default type's are
    computed on the device of megatron's buffer, with vLLM 0.24's expression (``RotaryEmbedding._compute_inv_freq``,
    which runs on the GPU): on the CPU they equal transformers', on a GPU vLLM's (``base ** x`` on the GPU may differ
    from the CPU's in the last bit). The probe of tests/test_gpu_exact.py still found q and k after RoPE apart with
    these: the rotation's rounding was the cause (:func:`megarl.kernels.batch_invariant.vllm_rotary`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = (spec.rope_scaling or {}).get("rope_type", "default")
    hf_config = spec.to_hf_config()
    if FAMILIES[spec.family].gemma:  # the global layers' (the local ones': megarl.models.gemma3)
        from megarl.models import gemma3

        inv_freq, scale = gemma3.rope_inv_freqs(spec)[0], 1.0
    elif rope_type == "default":  # on the rotated channels (GLM-4.5, Qwen3.5: a share of head_dim)
        base, dim, device = spec.rope_theta, 2 * rotary.inv_freq.numel(), rotary.inv_freq.device
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    if scale != 1.0 and not FAMILIES[spec.family].gpt_oss:  # gpt-oss: in the softmax scale (models/gpt_oss.py)
        raise SpecError(f"rope_type={rope_type!r} scales attention by {scale}; megarl supports only RoPE "
                        "variants that change the frequencies alone")
    rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device, dtype=rotary.inv_freq.dtype)
