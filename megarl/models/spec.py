"""Architecture specs: the one description of a decoder-only model that every other part reads.

A :class:`ModelSpec` is built from a Hugging Face ``config.json`` (or a named preset shape) and knows the
canonical (Hugging Face) name and shape of every weight. The Megatron builders, the reshard layouts, the
checkpoint converters and the rollout engines all derive from it, so a new model family is a new entry in
:data:`FAMILIES`, not a new code path.

Supported families: Llama (Llama 2/3, SmolLM2), Mistral and Qwen2/Qwen2.5 (bias on Q/K/V), Qwen3 (RMSNorm on
queries and keys, ``head_dim`` not tied to ``hidden / heads``), Phi-3/Phi-4 (q/k/v and gate/up fused in the
checkpoint), and the mixtures of experts Qwen3-MoE (RMSNorm on queries and keys), Qwen2-MoE (Q/K/V bias, a shared
expert with a sigmoid gate) and Mixtral. All have GQA, RoPE, RMSNorm, SwiGLU and tied or untied embeddings.

A mixture-of-experts spec (``num_experts > 0``) has a routed MoE block on every layer: a router (``gate``,
``[experts, hidden]``) picks the top ``moe_top_k`` experts of each token by softmax score, each expert is a SwiGLU
MLP of width ``moe_ffn_hidden_size``, and the block's output is the experts' outputs weighted by their scores
(renormalised over the top k when ``moe_norm_topk_prob``), plus, for Qwen2-MoE, the shared expert's output times
``sigmoid(shared_expert_gate(x))``. Its canonical tensors are those of the Hugging Face *checkpoint* (one 2-D tensor
per expert and projection, e.g. ``model.layers.0.mlp.experts.3.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.3.w1.weight``), which is what safetensors files hold and vLLM loads; transformers 5 fuses
them in memory into ``experts.gate_up_proj`` ``[experts, 2 * ffn, hidden]`` and ``experts.down_proj``
``[experts, hidden, ffn]`` (:mod:`megarl.models.layout` describes both).

DeepSeek-V3 (``deepseek_v3``; Moonlight, Kimi K2): multi-latent attention, shared experts, biased sigmoid routing and
dense first layers (:mod:`megarl.models.deepseek_spec`). GLM-4.5 (``glm4_moe``): GQA with partial RoPE, q/k/v bias and
optional QK-norm, and DeepSeek-V3's MoE (:mod:`megarl.models.glm4_moe`, :mod:`megarl.models.deepseek_moe`). Gemma 3
(text, ``gemma3_text``) adds (1 + weight) norms, post-attention and post-MLP norms, GeGLU, scaled embeddings and
local (sliding-window, own RoPE base) and global layers (:mod:`megarl.models.gemma3`). Qwen3.5 (``qwen3_5_text``),
Qwen3.5-MoE (``qwen3_5_moe_text``) and Qwen3-Next (``qwen3_next``) mix gated DeltaNet (linear attention) layers
with gated full-attention ones (:mod:`megarl.models.qwen3_5_spec`, ``gdn``). gpt-oss (``gpt_oss``) adds attention
sinks, biases, alternating window / full layers, YaRN and clamped SwiGLU
experts, whose fused checkpoint tensors are split into per-expert canonical ones (:mod:`megarl.models.gpt_oss`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megarl.models import deepseek_moe, deepseek_spec, gemma3_spec, glm4_moe, mixer, qwen3_5_spec, qwen3_phi3_spec
from megarl.models.deepseek_moe import DeepSeekMoE
from megarl.models.qwen3_5_spec import GatedDeltaNetShape
from megarl.models.deepseek_spec import MLA
from megarl.models.errors import SpecError
from megarl.models.glm4_moe import GLMAttention


class MoENames(NamedTuple):
    """How a mixture-of-experts family names its MoE block in Hugging Face checkpoints.

    Attributes:
        block: the layer's submodule holding router and experts (``mlp``; Mixtral: ``block_sparse_moe``).
        gate / up / down: an expert's projections (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral: ``w1``,
            ``w3``, ``w2``).
        router: the router's submodule (``gate``; gpt-oss: ``router``).
    """

    block: str
    gate: str
    up: str
    down: str
    router: str = "gate"


@dataclass(frozen=True)
class Family:
    """What differs between supported architecture families.

    Attributes:
        hf_architecture: the ``architectures[0]`` string of a Hugging Face config.
        model_type: the ``model_type`` string of a Hugging Face config.
        qkv_bias: whether q/k/v projections carry a bias (Qwen2: yes).
        qk_norm: RMSNorm of every query and key head (``q_norm``/``k_norm``, ``[head_dim]``; Qwen3).
        gemma: Gemma 3's decoder: (1 + weight) RMSNorms, a norm after attention and after the MLP as well
            (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), a GeGLU MLP, embeddings scaled by
            sqrt(hidden), sliding-window layers with their own RoPE base (:mod:`megarl.models.gemma3`).
        moe: checkpoint names of the MoE block (None: a dense family).
        sliding_window: the family's attention may have one window on every layer (Mistral, Mixtral, Phi-3).
        fused_qkv_mlp: the checkpoint holds q/k/v as one ``self_attn.qkv_proj`` (rows ``[q; k; v]``) and gate/up as
            one ``mlp.gate_up_proj`` (rows ``[gate; up]``), which are then the canonical tensors (Phi-3).
        gpt_oss: gpt-oss's decoder: a learned sink logit per attention head (``self_attn.sinks``), biases on
            o_proj, the router and the experts, clamped SwiGLU experts (:mod:`megarl.models.gpt_oss`).
        mla: multi-latent attention (:mod:`megarl.models.deepseek_spec`).
        deepseek_moe: DeepSeek-V3's MoE: biased sigmoid routing, shared experts, dense first layers
            (:mod:`megarl.models.deepseek_moe`; DeepSeek-V3, GLM-4.5).
        gdn: Qwen3.5's hybrid stack of gated DeltaNet and gated attention layers (:mod:`megarl.models.qwen3_5_spec`).
    """

    hf_architecture: str
    model_type: str
    qkv_bias: bool
    qk_norm: bool = False
    gemma: bool = False
    moe: MoENames | None = None
    sliding_window: bool = False
    fused_qkv_mlp: bool = False
    gpt_oss: bool = False
    mla: bool = False
    deepseek_moe: bool = False
    gdn: bool = False


_QWEN_MOE = MoENames("mlp", "gate_proj", "up_proj", "down_proj")
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", qkv_bias=False),
    "mistral": Family("MistralForCausalLM", "mistral", qkv_bias=False, sliding_window=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=False, qk_norm=True, moe=_QWEN_MOE),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "qwen2_moe", qkv_bias=True, moe=_QWEN_MOE),
    "mixtral": Family("MixtralForCausalLM", "mixtral", qkv_bias=False, sliding_window=True,
                      moe=MoENames("block_sparse_moe", "w1", "w3", "w2")),
    # issue 43: Qwen3 dense (QK-norm) and Phi-3/Phi-4 (fused qkv_proj and gate_up_proj)
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True),
    "phi3": Family("Phi3ForCausalLM", "phi3", qkv_bias=False, sliding_window=True, fused_qkv_mlp=True),
    # Gemma 3 text (Gemma3ForCausalLM; arXiv 2503.19786): QK-norm, sandwich norms, local and global layers
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", qkv_bias=False, qk_norm=True, sliding_window=True, gemma=True),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "deepseek_v3", qkv_bias=False, moe=_QWEN_MOE, mla=True,
                          deepseek_moe=True),
    # GLM-4.5 (q/k/v bias and QK-norm as its config says: ModelSpec.glm)
    glm4_moe.FAMILY: Family("Glm4MoeForCausalLM", "glm4_moe", qkv_bias=True, moe=_QWEN_MOE, deepseek_moe=True),
    # Qwen3.5 and Qwen3-Next: gated DeltaNet layers between gated attention layers
    "qwen3_5": Family("Qwen3_5ForCausalLM", "qwen3_5_text", qkv_bias=False, qk_norm=True, gdn=True),
    "qwen3_5_moe": Family("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", qkv_bias=False, qk_norm=True, gdn=True,
                          moe=_QWEN_MOE),
    "qwen3_next": Family("Qwen3NextForCausalLM", "qwen3_next", qkv_bias=False, qk_norm=True, gdn=True, moe=_QWEN_MOE),
    # gpt-oss (GptOssForCausalLM; OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv 2508.10925)
    "gpt_oss": Family("GptOssForCausalLM", "gpt_oss", qkv_bias=True, sliding_window=True, gpt_oss=True,
                      moe=MoENames("mlp", "gate_proj", "up_proj", "down_proj", router="router")),
}
GEMMA3, GPT_OSS = "gemma3", "gpt_oss"

# rope_type values whose effect is a change of the inverse frequencies alone (no attention scaling);
# the Megatron builder sets its RotaryEmbedding.inv_freq from transformers' own ROPE_INIT_FUNCTIONS.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (a family of :data:`FAMILIES`), in Hugging Face terms.

    Attributes:
        family: key of :data:`FAMILIES` ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "qwen2_moe",
            "mixtral", "gemma3", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next").
        vocab_size: rows of the (unpadded) embedding table.
        hidden_size: model width.
        num_layers: decoder layers.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (query groups); equals ``num_attention_heads`` for MHA.
        head_dim: channels per head.
        ffn_hidden_size: SwiGLU intermediate width (rows of gate_proj and of up_proj) of a dense MLP (an MoE
            family's config value, kept for its config; no layer has a dense MLP).
        rope_theta: RoPE base.
        rope_scaling: the config's ``rope_scaling``/``rope_parameters`` extras (``rope_type`` and its
            arguments) or None.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: output layer shares the embedding weight.
        max_position_embeddings: context length, tokens.
        bos_token_id / eos_token_ids / pad_token_id: special token ids from the config (eos may be several).
        sliding_window: Mistral's sliding-window attention on every layer: each token attends to itself and the
            ``sliding_window - 1`` tokens before it (None: full causal attention).
        num_experts: routed experts per MoE layer (0: a dense model).
        moe_top_k: experts each token is routed to.
        moe_ffn_hidden_size: an expert's SwiGLU width.
        shared_expert_ffn_hidden_size: the width of Qwen2-MoE's shared expert (0: none).
        moe_norm_topk_prob: the top-k scores are renormalised to sum to 1 (Mixtral: always).
        moe_aux_loss_coef: the load-balancing loss coefficient (``router_aux_loss_coef``).
        moe_z_loss_coef: the router z-loss coefficient (``router_z_loss_coef``; 0: none).
        sliding_window_pattern: Gemma 3, gpt-oss: per layer, 1 where it has the sliding window (a local layer), 0
            where it attends to every earlier token (a global layer); megatron's ``window_attn_skip_freq`` list.
            None: the window (if any) is on every layer.
        local_rope_theta: Gemma 3: the RoPE base of the local layers (``rope_local_base_freq``; the global layers'
            is ``rope_theta``, with ``rope_scaling``). None: every layer uses ``rope_theta``.
        query_pre_attn_scalar: Gemma 3: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (None:
            ``head_dim ** -0.5``).
        mla: DeepSeek-V3: its attention's fields (:class:`~megarl.models.deepseek_spec.MLA`); its
            ``head_dim`` is a query/key head's ``qk_nope + qk_rope`` channels, ``num_kv_heads`` its heads.
        deepseek_moe: DeepSeek-V3, GLM-4.5: their MoE's routing and dense first layers
            (:class:`~megarl.models.deepseek_moe.DeepSeekMoE`).
        glm: GLM-4.5: its attention's bias, QK-norm and partial RoPE (:class:`~megarl.models.glm4_moe.GLMAttention`).
        gdn: Qwen3.5: its gated DeltaNet layers' shape and the layer pattern (:class:`GatedDeltaNetShape`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0
    sliding_window_pattern: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    query_pre_attn_scalar: int | None = None
    mla: MLA | None = None
    deepseek_moe: DeepSeekMoE | None = None
    glm: GLMAttention | None = None
    gdn: GatedDeltaNetShape | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise SpecError(f"unknown model family {self.family!r}; supported: {sorted(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
                     "head_dim", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        fam = FAMILIES[self.family]
        if self.sliding_window is not None and (not fam.sliding_window or self.sliding_window < 1):
            raise SpecError(f"sliding_window={self.sliding_window}: megarl runs sliding-window attention on Mistral, "
                            "Mixtral and Phi-3 models (every layer, a window >= 1 token) only")
        if (fam.moe is not None) != (self.num_experts > 0):
            raise SpecError(f"num_experts={self.num_experts}: a {self.family} model "
                            f"{'has' if fam.moe else 'has no'} experts")
        if fam.moe is not None:
            if not 1 <= self.moe_top_k <= self.num_experts:
                raise SpecError(f"moe_top_k={self.moe_top_k} must be in [1, num_experts={self.num_experts}]")
            if self.moe_ffn_hidden_size < 1:
                raise SpecError(f"moe_ffn_hidden_size must be >= 1, got {self.moe_ffn_hidden_size}")
        if self.family == "mixtral" and self.ffn_hidden_size != self.moe_ffn_hidden_size:
            raise SpecError(f"a mixtral model's intermediate_size is its experts' width: ffn_hidden_size="
                            f"{self.ffn_hidden_size} must equal moe_ffn_hidden_size={self.moe_ffn_hidden_size}")
        if (self.shared_expert_ffn_hidden_size and self.family not in ("qwen2_moe", "qwen3_next", "qwen3_5_moe")
                and not fam.deepseek_moe):
            raise SpecError("a shared expert (shared_expert_ffn_hidden_size > 0) exists on qwen2_moe, qwen3_next, "
                            "qwen3_5_moe, deepseek_v3 and glm4_moe models only")
        if fam.mla or self.mla is not None:
            deepseek_spec.check(self)
        if fam.deepseek_moe or self.deepseek_moe is not None:
            if not fam.deepseek_moe:
                raise SpecError(f"deepseek_moe: a {self.family} model does not route as DeepSeek-V3")
            deepseek_moe.check(self)
        glm4_moe.check(self)
        if fam.gdn or self.gdn is not None:
            qwen3_5_spec.check(self)
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_kv_heads={self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES and not (fam.gpt_oss and rope_type == "yarn") and not fam.mla:
            raise SpecError(f"rope_scaling.rope_type={rope_type!r} is not supported; "
                            f"supported: {SUPPORTED_ROPE_TYPES}")
        if not fam.gemma and (self.sliding_window_pattern if not fam.gpt_oss else None, self.local_rope_theta,
                              self.query_pre_attn_scalar) != (None, None, None):
            raise SpecError("sliding_window_pattern (Gemma 3, gpt-oss), local_rope_theta and query_pre_attn_scalar "
                            "are Gemma 3 fields")
        if self.sliding_window_pattern is not None and (self.sliding_window is None or len(
                self.sliding_window_pattern) != self.num_layers or set(self.sliding_window_pattern) - {0, 1}):
            raise SpecError(f"sliding_window_pattern={self.sliding_window_pattern} must hold a 0 or 1 for each of the "
                            f"{self.num_layers} layers, and needs a sliding_window")

    # ------------------------------------------------------------------ derived sizes
    @property
    def qkv_bias(self) -> bool:
        return self.glm.attention_bias if self.glm is not None else FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.glm.qk_norm if self.glm is not None else FAMILIES[self.family].qk_norm

    @property
    def fused_qkv_mlp(self) -> bool:
        return FAMILIES[self.family].fused_qkv_mlp

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Number of parameters of the unpadded HF model (tied embeddings counted once)."""
        return sum(math.prod(s) for s in self.hf_tensor_shapes().values())

    def num_active_params(self) -> int:
        """Parameters one token computes with: :meth:`num_params` less the experts it is not routed to
        (``num_experts - moe_top_k`` of every MoE layer's experts); the same as :meth:`num_params` for a dense
        model."""
        h, m = self.hidden_size, self.moe_ffn_hidden_size
        moe_layers = sum(deepseek_moe.is_moe_layer(self, i) for i in range(self.num_layers))
        idle = moe_layers * (self.num_experts - self.moe_top_k) * (
            3 * h * m + (2 * m + h) * FAMILIES[self.family].gpt_oss)  # gpt-oss: the experts' biases
        return self.num_params() - idle

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Canonical names of expert ``expert``'s gate, up and down projections on layer ``layer``
        (shapes ``[moe_ffn, hidden]``, ``[moe_ffn, hidden]``, ``[hidden, moe_ffn]``); gpt-oss's gate and up are one
        tensor instead (:func:`megarl.models.gpt_oss.expert_tensors`), the prefix of these names.

        Raises:
            SpecError: a dense model.
        """
        names = FAMILIES[self.family].moe
        if names is None:
            raise SpecError(f"a {self.family} model has no experts")
        p = f"model.layers.{layer}.{names.block}.experts.{expert}."
        return p + names.gate + ".weight", p + names.up + ".weight", p + names.down + ".weight"

    def router_name(self, layer: int) -> str:
        """Canonical name of layer ``layer``'s router weight ``[num_experts, hidden]``."""
        names = FAMILIES[self.family].moe
        return f"model.layers.{layer}.{names.block}.{names.router}.weight"

    # ------------------------------------------------------------------ where q/k/v and gate/up rows live
    def qkv_sources(self, layer: int, suffix: str = "weight") -> tuple[tuple[str, int], ...]:
        """Where layer ``layer``'s query, key and value rows start: ``((name, row), ...)`` for q, k and v, each
        ``q_size`` / ``kv_size`` / ``kv_size`` rows (of a weight, or of a bias with ``suffix="bias"``): their own
        tensors (row 0), or rows ``0``, ``q_size``, ``q_size + kv_size`` of the fused ``self_attn.qkv_proj``
        (:attr:`Family.fused_qkv_mlp`)."""
        p = f"model.layers.{layer}.self_attn."
        if self.fused_qkv_mlp:
            return ((p + f"qkv_proj.{suffix}", 0), (p + f"qkv_proj.{suffix}", self.q_size),
                    (p + f"qkv_proj.{suffix}", self.q_size + self.kv_size))
        return tuple((p + f"{x}_proj.{suffix}", 0) for x in "qkv")

    def gate_up_sources(self, layer: int) -> tuple[tuple[str, int], tuple[str, int]]:
        """Where dense layer ``layer``'s gate and up rows (``ffn_hidden_size`` each) start: ``((name, row),
        (name, row))``; rows ``0`` and ``ffn_hidden_size`` of the fused ``mlp.gate_up_proj`` (Phi-3)."""
        p = f"model.layers.{layer}.mlp."
        if self.fused_qkv_mlp:
            return (p + "gate_up_proj.weight", 0), (p + "gate_up_proj.weight", self.ffn_hidden_size)
        return (p + "gate_proj.weight", 0), (p + "up_proj.weight", 0)

    # ------------------------------------------------------------------ canonical tensors
    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every canonical (Hugging Face) tensor, in ``state_dict`` order."""
        h, f = self.hidden_size, self.ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            if self.mla is not None or self.gdn is not None:
                shapes.update(mixer.attention_shapes(self, i))
            elif self.fused_qkv_mlp:
                shapes[p + "self_attn.qkv_proj.weight"] = (self.q_size + 2 * self.kv_size, h)
            else:
                shapes[p + "self_attn.q_proj.weight"] = (self.q_size, h)
                shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
                shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (self.kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (self.kv_size,)
            if self.mla is None and self.gdn is None:
                shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if FAMILIES[self.family].gpt_oss:
                shapes.update({p + "self_attn.o_proj.bias": (h,), p + "self_attn.sinks": (self.num_attention_heads,)})
            if self.qk_norm and self.gdn is None:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            if deepseek_moe.is_moe_layer(self, i):
                shapes.update(self._moe_shapes(i))
            elif self.fused_qkv_mlp:
                shapes[p + "mlp.gate_up_proj.weight"] = (2 * f, h)
                shapes[p + "mlp.down_proj.weight"] = (h, f)
            else:
                shapes[p + "mlp.gate_proj.weight"] = (f, h)
                shapes[p + "mlp.up_proj.weight"] = (f, h)
                shapes[p + "mlp.down_proj.weight"] = (h, f)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if FAMILIES[self.family].gemma:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
                shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def _moe_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        h, m = self.hidden_size, self.moe_ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {self.router_name(i): (self.num_experts, h)}
        biased = FAMILIES[self.family].gpt_oss  # gpt-oss: a bias on the router and on each expert's projections
        if biased:
            shapes[self.router_name(i).removesuffix("weight") + "bias"] = (self.num_experts,)
        for e in range(self.num_experts):
            gate, up, down = self.expert_names(i, e)
            if biased:  # gate and up rows interleaved in one tensor, as gpt-oss's checkpoint and vLLM hold them
                p = gate.removesuffix("gate_proj.weight")
                shapes.update({p + "gate_up_proj.weight": (2 * m, h), p + "gate_up_proj.bias": (2 * m,),
                               down: (h, m), down.removesuffix("weight") + "bias": (h,)})
            else:
                shapes.update({gate: (m, h), up: (m, h), down: (h, m)})
        if self.deepseek_moe is not None:
            shapes.update(deepseek_moe.moe_extra_shapes(self, i))
        elif self.shared_expert_ffn_hidden_size:
            s, p = self.shared_expert_ffn_hidden_size, f"model.layers.{i}.mlp."
            shapes.update({p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                           p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)})
        return shapes

    # ------------------------------------------------------------------ HF config round trip
    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | Any) -> "ModelSpec":
        """Build a spec from a Hugging Face config (a ``config.json`` dict or a ``PretrainedConfig``).

        Raises:
            SpecError: unknown architecture/model_type, or a feature megarl does not support
                (MLP bias, Qwen2's sliding-window attention on some layers, unsupported RoPE scaling).
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        gemma3_spec.refuse_multimodal(model_type, archs)
        qwen3_5_spec.refuse_multimodal(model_type, archs)
        family = next((k for k, f in FAMILIES.items() if f.model_type == model_type), None)
        if family is None:
            family = next((k for k, f in FAMILIES.items() if f.hf_architecture in archs), None)
        if family is None:
            raise SpecError(f"unknown architecture: model_type={model_type!r}, architectures={archs}; "
                            f"megarl supports {[f.hf_architecture for f in FAMILIES.values()]}")
        if cfg.get("mlp_bias"):
            raise SpecError("mlp_bias=True is not supported (Llama/Qwen2 MLPs have no bias)")
        if family == "llama" and cfg.get("attention_bias"):
            raise SpecError("attention_bias=True on a Llama model is not supported")
        if family == "qwen3_moe" and cfg.get("attention_bias"):
            raise SpecError("attention_bias=True on a qwen3_moe model is not supported")
        if family == "qwen2_moe" and not cfg.get("qkv_bias", True):
            raise SpecError("qkv_bias=False on a qwen2_moe model is not supported")
        if family in ("qwen3", "phi3"):
            qwen3_phi3_spec.check(family, cfg)
        windowed = FAMILIES[family].sliding_window
        if not windowed and cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
            raise SpecError(f"sliding-window attention on some layers of a {family} model (use_sliding_window="
                            "true) is not supported; megarl runs it on Mistral, Mixtral and Phi-3 models, where every "
                            "layer has it. Set use_sliding_window=false in config.json to train with full attention")
        window = cfg.get("sliding_window") if windowed else None
        if window is not None and window >= cfg.get("max_position_embeddings", 4096):
            window = None  # a window as long as the context: full causal attention
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        elif "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        if FAMILIES[family].gemma:
            theta, rope, window, gemma = gemma3_spec.fields_from_hf(cfg)
        elif FAMILIES[family].gpt_oss:
            from megarl.models import gpt_oss

            window, gemma = gpt_oss.spec_fields(cfg)
        elif FAMILIES[family].gdn:
            gemma, rope = qwen3_5_spec.fields_from_hf(cfg), {}
        else:
            gemma = {}
        return cls(**{**dict(  # a family's own fields (_moe_fields, Gemma 3's) replace the common ones
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            ffn_hidden_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],  # Qwen3.5-MoE: none
            rope_theta=theta,
            rope_scaling=rope or None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", FAMILIES[family].gemma)),  # Gemma: tied
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            sliding_window=window,
        ), **_moe_fields(family, cfg), **gemma})

    def to_hf_config(self):
        """The transformers ``PretrainedConfig`` of this spec's family (LlamaConfig, Qwen3Config, Phi3Config, ...)."""
        import transformers

        fam = FAMILIES[self.family]
        config_cls = transformers.AutoConfig.for_model(fam.model_type).__class__
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope.update(self.rope_scaling or {})
        kwargs = dict(
            architectures=[fam.hf_architecture],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.ffn_hidden_size,
            rope_parameters=rope,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            pad_token_id=self.pad_token_id,
            hidden_act="silu",
            attention_dropout=0.0,
        )
        if self.family == "llama":
            kwargs.update(attention_bias=False, mlp_bias=False)
        if self.family == "qwen2":
            kwargs.update(use_sliding_window=False, sliding_window=None)
        if self.family in ("mistral", "mixtral"):
            kwargs.update(sliding_window=self.sliding_window)
        if FAMILIES[self.family].gemma:
            kwargs.update(gemma3_spec.hf_config_kwargs(self))
            del kwargs["hidden_act"]
        if self.is_moe:
            kwargs.update(num_experts_per_tok=self.moe_top_k, router_aux_loss_coef=self.moe_aux_loss_coef)
            if self.moe_z_loss_coef:
                kwargs.update(router_z_loss_coef=self.moe_z_loss_coef)
        if self.family == "mixtral":
            kwargs.update(num_local_experts=self.num_experts, intermediate_size=self.moe_ffn_hidden_size)
        if self.family in ("qwen3_moe", "qwen2_moe"):
            kwargs.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_ffn_hidden_size,
                          norm_topk_prob=self.moe_norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                          use_sliding_window=False, sliding_window=None)
        if self.family == "qwen3_moe":
            kwargs.update(attention_bias=False)
        if self.family == "qwen2_moe":
            kwargs.update(shared_expert_intermediate_size=self.shared_expert_ffn_hidden_size, qkv_bias=True)
        if self.family in ("qwen3", "phi3"):
            kwargs.update(qwen3_phi3_spec.hf_config_kwargs(self))
        if fam.gpt_oss:
            from megarl.models import gpt_oss

            kwargs.update(gpt_oss.hf_config_kwargs(self))
        if self.mla is not None:
            kwargs.update(deepseek_spec.hf_config_kwargs(self))
        if self.glm is not None:
            kwargs.update(glm4_moe.hf_config_kwargs(self))
        if self.gdn is not None:
            kwargs.update(qwen3_5_spec.hf_config_kwargs(self))
        return config_cls(**kwargs)

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _moe_fields(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a :class:`ModelSpec` from a Hugging Face config (none for a dense family; DeepSeek-V3's,
    its attention's too: :func:`~megarl.models.deepseek_spec.fields_from_hf`).

    Raises:
        SpecError: dense MLPs on some layers (``mlp_only_layers``, ``decoder_sparse_step > 1``), a Qwen2-MoE
            shared expert without its gate, or a field the family needs missing.
    """
    if FAMILIES[family].moe is None:
        return {}
    if FAMILIES[family].mla:
        return deepseek_spec.fields_from_hf(cfg)
    if family == glm4_moe.FAMILY:
        return glm4_moe.fields_from_hf(cfg)
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise SpecError(f"a {family} model with dense MLPs on some layers (mlp_only_layers="
                        f"{cfg.get('mlp_only_layers')}, decoder_sparse_step={cfg.get('decoder_sparse_step')}) is not "
                        "supported; megarl builds an MoE block on every layer")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise SpecError(f"a {family} config needs num_experts (or num_local_experts)")
    mixtral = family in ("mixtral", GPT_OSS)  # intermediate_size is the experts' width, top-k renormalised
    return dict(
        num_experts=int(experts),
        moe_top_k=int(cfg["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        moe_norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        moe_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0),
        moe_z_loss_coef=float(cfg.get("router_z_loss_coef") or 0.0),
    )


# Named shapes for benchmarks, GPU configs and tests (random weights); sources and what is unchecked: test_presets.py
PRESETS: dict[str, ModelSpec] = {
    # a tiny Llama with SmolLM2's vocabulary (use its tokenizer: model.tokenizer=default), for CPU sweeps
    "tiny-llama": ModelSpec("llama", 49152, 64, 4, 4, 2, 16, 128, rope_theta=10000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=1,
                            eos_token_ids=(2,), pad_token_id=2),
    # smollm2-135m, qwen2.5-*, llama-3-8b: litgpt 0.5.13 (from the config.json files); token ids, contexts unchecked
    "smollm2-135m": ModelSpec("llama", 49152, 576, 30, 9, 3, 64, 1536, rope_theta=100000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
                              bos_token_id=1, eos_token_ids=(2,), pad_token_id=2),
    "qwen2.5-0.5b": ModelSpec("qwen2", 151936, 896, 24, 14, 2, 64, 4864, rope_theta=1e6,
                              tie_word_embeddings=True, max_position_embeddings=32768,
                              eos_token_ids=(151645,), pad_token_id=151643),
    "qwen2.5-1.5b": ModelSpec("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, rope_theta=1e6,
                              tie_word_embeddings=True, max_position_embeddings=32768,
                              eos_token_ids=(151645,), pad_token_id=151643),
    "qwen2.5-7b": ModelSpec("qwen2", 152064, 3584, 28, 28, 4, 128, 18944, rope_theta=1e6,
                            tie_word_embeddings=False, max_position_embeddings=32768,
                            eos_token_ids=(151645,), pad_token_id=151643),
    "llama-3-8b": ModelSpec("llama", 128256, 4096, 32, 32, 8, 128, 14336, rope_theta=500000.0,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192,
                            bos_token_id=128000, eos_token_ids=(128001, 128009)),
    # Qwen/Qwen3-* (litgpt: head_dim 128, QK-norm, 40960 context); tying and token ids: copies of the 4B's, 8B's
    **{f"qwen3-{size}": ModelSpec("qwen3", 151936, hidden, layers, heads, 8, 128, ffn, rope_theta=1e6,
                                  rms_norm_eps=1e-6, tie_word_embeddings=tied, max_position_embeddings=40960,
                                  bos_token_id=151643, eos_token_ids=(151645,), pad_token_id=151643)
       for size, hidden, layers, heads, ffn, tied in (("0.6b", 1024, 28, 16, 3072, True),
                                                      ("1.7b", 2048, 28, 16, 6144, True),
                                                      ("4b", 2560, 36, 32, 9728, True),
                                                      ("8b", 4096, 36, 32, 12288, False),
                                                      ("14b", 5120, 40, 40, 17408, False),
                                                      ("32b", 5120, 64, 64, 25600, False))},
    # Phi-3-mini-4k-instruct: transformers Phi3Config defaults, window 2047 (config copies); phi-4: litgpt
    "phi-3-mini": ModelSpec("phi3", 32064, 3072, 32, 32, 32, 96, 8192, rope_theta=10000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=False, max_position_embeddings=4096, bos_token_id=1,
                            eos_token_ids=(32000,), pad_token_id=32000, sliding_window=2047),
    "phi-4": ModelSpec("phi3", 100352, 5120, 40, 40, 10, 128, 17920, rope_theta=250000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, max_position_embeddings=16384, bos_token_id=100257,
                       eos_token_ids=(100265,), pad_token_id=100349),
    # a tiny Qwen3-MoE (8 experts, top-2) with SmolLM2's vocabulary (model.tokenizer=default), for CPU sweeps
    "tiny-qwen3-moe": ModelSpec("qwen3_moe", 49152, 64, 4, 4, 2, 16, 128, rope_theta=10000.0, rms_norm_eps=1e-6,
                                tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=1,
                                eos_token_ids=(2,), pad_token_id=2, num_experts=8, moe_top_k=2,
                                moe_ffn_hidden_size=32, moe_aux_loss_coef=0.001),
    # Qwen/Qwen3-30B-A3B (3.3B active): transformers Qwen3MoeConfig defaults + litgpt; token ids unchecked
    "qwen3-30b-a3b": ModelSpec("qwen3_moe", 151936, 2048, 48, 32, 4, 128, 6144, rope_theta=1e6, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, max_position_embeddings=40960, bos_token_id=151643,
                               eos_token_ids=(151645,), pad_token_id=151643, num_experts=128, moe_top_k=8,
                               moe_ffn_hidden_size=768, moe_norm_topk_prob=True, moe_aux_loss_coef=0.001),
}
# Gemma 3 text (google/gemma-3-{1b,27b}-*; the 27B's text model): litgpt + Megatron-Bridge's test configs; eos unchecked
PRESETS.update({
    "gemma3-1b": ModelSpec("gemma3", 262144, 1152, 26, 4, 1, 256, 6912, rope_theta=1e6, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, max_position_embeddings=32768, bos_token_id=2,
                           eos_token_ids=(1, 106), pad_token_id=0, sliding_window=512,
                           sliding_window_pattern=tuple(int(i % 6 != 5) for i in range(26)), local_rope_theta=1e4,
                           query_pre_attn_scalar=256),
    "gemma3-27b": ModelSpec("gemma3", 262208, 5376, 62, 32, 16, 128, 21504, rope_theta=1e6,
                            rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=2,
                            eos_token_ids=(1, 106), pad_token_id=0, sliding_window=1024,
                            sliding_window_pattern=tuple(int(i % 6 != 5) for i in range(62)), local_rope_theta=1e4,
                            query_pre_attn_scalar=168),
})

# openai/gpt-oss-{20b,120b}, bf16 (the release is MXFP4): transformers GptOssConfig defaults (120b) + config copies
PRESETS.update({f"gpt-oss-{size}": ModelSpec(
    "gpt_oss", 201088, 2880, layers, 64, 8, 64, 2880, rope_theta=150000.0, rope_scaling={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}, rms_norm_eps=1e-5, max_position_embeddings=131072,
    eos_token_ids=(200002,), pad_token_id=199999, sliding_window=128, sliding_window_pattern=(1, 0) * (layers // 2),
    num_experts=experts, moe_top_k=4, moe_ffn_hidden_size=2880, moe_aux_loss_coef=0.9)
    for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))})

PRESETS.update(deepseek_spec.presets(ModelSpec))  # deepseek-v3, moonlight-16b-a3b
PRESETS.update(glm4_moe.presets(ModelSpec))  # glm-4.5, glm-4.5-air
PRESETS.update(qwen3_5_spec.presets(ModelSpec))  # qwen3.5-27b, qwen3-next-80b-a3b


def preset(name: str) -> ModelSpec:
    """Look up a named shape in :data:`PRESETS`; ``NAME?layers=N`` keeps its first ``N`` layers (one-GPU
    benchmarks of a large model's shape, e.g. ``qwen3-30b-a3b?layers=4``; a DeepSeek-V3 shape keeps at most
    ``N - 1`` dense first layers).

    Raises:
        SpecError: unknown name (the message lists the known ones), or a bad ``?layers=`` option.
    """
    base, _, options = name.partition("?")
    try:
        spec = PRESETS[base.lower()]
    except KeyError:
        raise SpecError(f"unknown model preset {base!r}; known: {sorted(PRESETS)}") from None
    if not options:
        return spec
    key, _, value = options.partition("=")
    if key != "layers" or not value.isdigit() or not 1 <= int(value) <= spec.num_layers:
        raise SpecError(f"preset {name!r}: the only option is ?layers=N with 1 <= N <= {spec.num_layers} "
                        f"(the layers of {base}), e.g. preset:{base}?layers=4")
    pattern = spec.sliding_window_pattern  # Gemma 3: the first N layers' local/global pattern
    moe = spec.deepseek_moe and dataclasses.replace(  # DeepSeek-V3, GLM-4.5: at least one MoE layer (the last)
        spec.deepseek_moe, first_k_dense=min(spec.deepseek_moe.first_k_dense, int(value) - 1))
    gdn = spec.gdn and dataclasses.replace(spec.gdn, linear_pattern=spec.gdn.linear_pattern[:int(value)])
    return spec.replace(num_layers=int(value), sliding_window_pattern=pattern and pattern[:int(value)],
                        deepseek_moe=moe, gdn=gdn)
