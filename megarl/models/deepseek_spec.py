"""The DeepSeek-V3 family's description (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``; Moonlight and Kimi K2
have the same shape): multi-latent attention and a mixture of experts with shared experts and biased sigmoid routing.

Multi-latent attention (MLA; DeepSeek-AI, "DeepSeek-V2", arXiv 2405.04434, section 2.1, eqs. 9-19) projects the
hidden state down to a latent ``c_KV`` of ``kv_lora_rank`` channels plus one shared rotary key of
``qk_rope_head_dim`` channels (``kv_a_proj_with_mqa``, ``[kv_lora_rank + qk_rope_head_dim, hidden]``), normalises
the latent (``kv_a_layernorm``) and projects it up to every head's key (``qk_nope_head_dim``) and value
(``v_head_dim``) channels (``kv_b_proj``, ``[heads * (qk_nope + v), kv_lora_rank]``, per head ``[k_nope; v]``). Queries
come from the hidden state directly (``q_proj``, ``q_lora_rank`` None: Moonlight, DeepSeek-V2-Lite) or through a
latent of their own (``q_a_proj`` ``[q_lora_rank, hidden]``, ``q_a_layernorm``, ``q_b_proj`` ``[heads * (qk_nope +
qk_rope), q_lora_rank]``: DeepSeek-V3, Kimi K2); per head ``[q_nope; q_rope]``. RoPE rotates the ``qk_rope`` channels
in interleaved pairs (``rope_interleave``), as megatron-core's MLA does; YaRN scaling (DeepSeek-V3's factor 40) also
scales the softmax by ``mscale(factor, mscale_all_dim) ** 2``.

The MoE block (shared experts, biased sigmoid routing, dense first layers, multi-token prediction layers dropped)
is :mod:`megarl.models.deepseek_moe`'s, which GLM-4.5 shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from megarl.models import deepseek_moe
from megarl.models.deepseek_moe import DeepSeekMoE
from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike

S = TypeVar("S", bound=SpecLike)

# rope_type values the MLA builder runs: plain RoPE and DeepSeek's YaRN (megatron's YarnRotaryEmbedding)
MLA_ROPE_TYPES = ("default", "yarn")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class MLA:
    """What a DeepSeek-V3 model adds to a :class:`~megarl.models.spec.ModelSpec` (its ``mla`` field).

    Attributes:
        q_lora_rank: the query latent's width (None: queries projected directly, ``q_proj``).
        kv_lora_rank: the key/value latent's width.
        qk_nope_head_dim / qk_rope_head_dim: a query/key head's channels without / with RoPE.
        v_head_dim: a value head's channels.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """A query/key head's channels (``qk_nope_head_dim + qk_rope_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _error(message: str) -> SpecError:
    return SpecError(message)


def fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~megarl.models.spec.ModelSpec` fields of a ``deepseek_v3`` config that differ from the common ones
    (head sizes, MoE fields: :func:`megarl.models.deepseek_moe.fields_from_hf`, RoPE and :class:`MLA`).

    Raises:
        SpecError: what megarl's megatron-core model would compute differently from transformers' and vLLM's:
            attention biases, non-interleaved RoPE, a RoPE scaling other than YaRN, grouped KV heads, and the MoE's
            (:func:`megarl.models.deepseek_moe.fields_from_hf`).
    """
    for key, bad, why in (("attention_bias", True, "the released checkpoints have none"),
                          ("rope_interleave", False, "megatron-core's MLA rotates interleaved channel pairs")):
        if bool(cfg.get(key, not bad)) == bad:
            raise _error(f"{key}={bad} on a deepseek_v3 model is not supported ({why}); use a checkpoint with "
                         f"{key}={not bad}")
    moe = deepseek_moe.fields_from_hf("deepseek_v3", cfg)
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise _error(f"num_key_value_heads={cfg['num_key_value_heads']} != num_attention_heads={heads}: multi-latent "
                     "attention makes every head's key and value from the latent; set them equal")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in MLA_ROPE_TYPES:
        raise _error(f"rope_scaling.rope_type={rope_type!r} on a deepseek_v3 model is not supported; megatron-core's "
                     f"MLA runs {MLA_ROPE_TYPES}")
    scaling = None
    if rope_type == "yarn":
        scaling = {"rope_type": "yarn", **{k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}}
        if "factor" not in scaling:
            raise _error("rope_scaling: a yarn RoPE needs its factor")
    q_lora = cfg.get("q_lora_rank")
    return dict(
        head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
        num_kv_heads=heads,
        rope_theta=theta,
        rope_scaling=scaling,
        mla=MLA(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg["v_head_dim"])),
        **moe,
    )


def check(spec: SpecLike) -> None:
    """Validate a DeepSeek-V3 spec's own fields (:meth:`ModelSpec.__post_init__`).

    Raises:
        SpecError: a field out of range, or an ``mla`` on another family (or none on this one).
    """
    m = spec.mla
    if m is None:
        raise _error("a deepseek_v3 spec needs its multi-latent attention fields (mla=MLA(...))")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, name) < 1:
            raise _error(f"mla.{name} must be >= 1, got {getattr(m, name)}")
    if m.qk_rope_head_dim % 2 or (m.q_lora_rank is not None and m.q_lora_rank < 1):
        raise _error(f"mla.qk_rope_head_dim={m.qk_rope_head_dim} must be even and q_lora_rank={m.q_lora_rank} None "
                     "or >= 1")
    if spec.head_dim != m.qk_head_dim or spec.num_kv_heads != spec.num_attention_heads:
        raise _error(f"a deepseek_v3 spec's head_dim is qk_nope_head_dim + qk_rope_head_dim = {m.qk_head_dim} and its "
                     f"num_kv_heads its num_attention_heads; got {spec.head_dim}, {spec.num_kv_heads}")
    rope_type = (spec.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in MLA_ROPE_TYPES:
        raise _error(f"rope_scaling.rope_type={rope_type!r}: a deepseek_v3 model runs {MLA_ROPE_TYPES}")


def attention_shapes(spec: SpecLike, layer: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of layer ``layer``'s multi-latent attention tensors, in transformers' order."""
    m, h, heads = spec.mla, spec.hidden_size, spec.num_attention_heads
    p = f"model.layers.{layer}.self_attn."
    if m.q_lora_rank is None:
        shapes = {p + "q_proj.weight": (heads * m.qk_head_dim, h)}
    else:
        shapes = {p + "q_a_proj.weight": (m.q_lora_rank, h), p + "q_a_layernorm.weight": (m.q_lora_rank,),
                  p + "q_b_proj.weight": (heads * m.qk_head_dim, m.q_lora_rank)}
    shapes.update({p + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
                   p + "kv_a_layernorm.weight": (m.kv_lora_rank,),
                   p + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                   p + "o_proj.weight": (h, heads * m.v_head_dim)})
    return shapes


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The ``DeepseekV3Config`` arguments of a spec beyond the common ones (its MoE's:
    :func:`megarl.models.deepseek_moe.hf_config_kwargs`)."""
    m = spec.mla
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta, **(spec.rope_scaling or {})}
    return dict(head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=True,
                attention_bias=False, rope_parameters=rope, **deepseek_moe.hf_config_kwargs(spec),
                scoring_func="sigmoid", topk_method="noaux_tc")  # what vLLM's DeepseekV2MoE reads for this routing


def presets(model_spec: Callable[..., S]) -> dict[str, S]:
    """Named DeepSeek-V3 shapes (:data:`megarl.models.spec.PRESETS`): deepseek-ai/DeepSeek-V3 (671B, 37B active: a
    query latent, 8 groups, YaRN factor 40, one MTP layer dropped) and moonshotai/Moonlight-16B-A3B-Instruct (no
    query latent, one group, plain RoPE). Sources: tests/test_presets.py."""
    def spec(vocab, hidden, layers, heads, ffn, *, mla: MLA, moe: DeepSeekMoE, experts, top_k, moe_ffn, shared,
             rope_theta, rope, max_pos, bos, eos, eps=1e-6) -> S:
        return model_spec("deepseek_v3", vocab, hidden, layers, heads, heads, mla.qk_head_dim, ffn,
                          rope_theta=rope_theta, rope_scaling=rope, rms_norm_eps=eps, tie_word_embeddings=False,
                          max_position_embeddings=max_pos, bos_token_id=bos, eos_token_ids=(eos,),
                          num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=moe_ffn,
                          shared_expert_ffn_hidden_size=shared * moe_ffn, mla=mla, deepseek_moe=moe)

    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return {
        # transformers DeepseekV3Config defaults = DeepSeek-V3; max_pos and YaRN from copies of its config.json
        "deepseek-v3": spec(129280, 7168, 61, 128, 18432, experts=256, top_k=8, moe_ffn=2048, shared=1,
                            rope_theta=10000.0, rope=yarn, max_pos=163840, bos=0, eos=1,
                            mla=MLA(1536, 512, 128, 64, 128),
                            moe=DeepSeekMoE(first_k_dense=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                            mtp_layers=1)),
        # a copy of Moonlight-16B-A3B-Instruct's config.json (revision 4e735b07) in a public repository
        "moonlight-16b-a3b": spec(163840, 2048, 27, 16, 11264, experts=64, top_k=6, moe_ffn=1408, shared=2,
                                  rope_theta=50000.0, rope=None, max_pos=8192, bos=163584, eos=163586, eps=1e-5,
                                  mla=MLA(None, 512, 128, 64, 128),
                                  moe=DeepSeekMoE(first_k_dense=1, routed_scaling_factor=2.446)),
    }
