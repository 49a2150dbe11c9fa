"""Architecture specs: the one description of a decoder-only model that every other part reads.

A :class:`ModelSpec` is built from a Hugging Face ``config.json`` (or a named preset shape) and knows the
canonical (Hugging Face) name and shape of every weight. The Megatron builders, the reshard layouts, the
checkpoint converters and the rollout engines all derive from it, so a new model family is a new entry in
:data:`FAMILIES`, not a new code path.

Supported families: Llama (Llama 2/3, SmolLM2), Mistral and Qwen2/Qwen2.5 (bias on Q/K/V). All have GQA,
RoPE, RMSNorm, SwiGLU and tied or untied embeddings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


class SpecError(ValueError):
    """A model config that megarl cannot build, or a layout that does not fit the model."""


@dataclass(frozen=True)
class Family:
    """What differs between supported architecture families.

    Attributes:
        hf_architecture: the ``architectures[0]`` string of a Hugging Face config.
        model_type: the ``model_type`` string of a Hugging Face config.
        qkv_bias: whether q/k/v projections carry a bias (Qwen2: yes).
    """

    hf_architecture: str
    model_type: str
    qkv_bias: bool


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", qkv_bias=False),
    "mistral": Family("MistralForCausalLM", "mistral", qkv_bias=False),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
}

# rope_type values whose effect is a change of the inverse frequencies alone (no attention scaling);
# the Megatron builder sets its RotaryEmbedding.inv_freq from transformers' own ROPE_INIT_FUNCTIONS.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama/Mistral/Qwen2 family), in Hugging Face terms.

    Attributes:
        family: key of :data:`FAMILIES` ("llama", "mistral", "qwen2").
        vocab_size: rows of the (unpadded) embedding table.
        hidden_size: model width.
        num_layers: decoder layers.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (query groups); equals ``num_attention_heads`` for MHA.
        head_dim: channels per head.
        ffn_hidden_size: SwiGLU intermediate width (rows of gate_proj and of up_proj).
        rope_theta: RoPE base.
        rope_scaling: the config's ``rope_scaling``/``rope_parameters`` extras (``rope_type`` and its
            arguments) or None.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: output layer shares the embedding weight.
        max_position_embeddings: context length, tokens.
        bos_token_id / eos_token_ids / pad_token_id: special token ids from the config (eos may be several).
        sliding_window: Mistral's sliding-window attention on every layer: each token attends to itself and the
            ``sliding_window - 1`` tokens before it (None: full causal attention).
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
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise SpecError(f"unknown model family {self.family!r}; supported: {sorted(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
                     "head_dim", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sliding_window is not None and (self.family != "mistral" or self.sliding_window < 1):
            raise SpecError(f"sliding_window={self.sliding_window}: megarl runs sliding-window attention on Mistral "
                            "models (every layer, a window >= 1 token) only")
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_kv_heads={self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise SpecError(f"rope_scaling.rope_type={rope_type!r} is not supported; "
                            f"supported: {SUPPORTED_ROPE_TYPES}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.family].qkv_bias

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

    # ------------------------------------------------------------------ canonical tensors
    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every canonical (Hugging Face) tensor, in ``state_dict`` order."""
        h, f = self.hidden_size, self.ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (self.kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (self.kv_size,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
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
        if family != "mistral" and cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
            raise SpecError(f"sliding-window attention on some layers of a {family} model (use_sliding_window="
                            "true) is not supported; megarl runs it on Mistral models, where every layer has it. "
                            "Set use_sliding_window=false in config.json to train with full attention")
        window = cfg.get("sliding_window") if family == "mistral" else None
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
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            rope_theta=theta,
            rope_scaling=rope or None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            sliding_window=window,
        )

    def to_hf_config(self):
        """The transformers ``PretrainedConfig`` (LlamaConfig, MistralConfig or Qwen2Config) of this spec."""
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
        if self.family == "mistral":
            kwargs.update(sliding_window=self.sliding_window)
        return config_cls(**kwargs)

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# Named shapes for benchmarks, GPU configs and tests (weights are random or loaded separately).
PRESETS: dict[str, ModelSpec] = {
    # a tiny Llama with SmolLM2's vocabulary (use its tokenizer: model.tokenizer=default), for CPU sweeps
    "tiny-llama": ModelSpec("llama", 49152, 64, 4, 4, 2, 16, 128, rope_theta=10000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=1,
                            eos_token_ids=(2,), pad_token_id=2),
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
}


def preset(name: str) -> ModelSpec:
    """Look up a named shape in :data:`PRESETS`.

    Raises:
        SpecError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise SpecError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
