"""The trainer's half of exact on-policy (``rollout.exact``; docs/DESIGN.md, "Exact on-policy"): the old-log-prob
pass on the kernels of vLLM's batch-invariant mode.

vLLM 0.24's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, ``vllm/model_executor/layers/batch_invariant.py``)
has two halves, read in its source:

- process-wide overrides, installed by ``init_batch_invariance()`` when the engine's worker starts: ``torch.library``
  implementations of ``aten::_log_softmax``, ``aten::softmax``/``_softmax``, ``aten::mean.dim`` and ``aten::bmm``
  on CUDA (Triton kernels whose reduction order does not depend on the batch), on SM80 also ``aten::mm``,
  ``addmm``, ``matmul`` and ``linear`` (a persistent Triton matmul), on SM90+ cuBLASLt without split-K
  (``CUBLAS_WORKSPACE_CONFIG=:16:8``, ``CUBLASLT_WORKSPACE_SIZE=1``), reduced-precision reductions off, TF32
  off;
- vLLM's own layers calling its kernels directly: every unquantised linear layer ``linear_batch_invariant``
  (the persistent Triton matmul, whatever the GPU), every ``RMSNorm`` ``rms_norm_batch_invariant`` (without a
  residual a Triton kernel of one program per row; with one, which every norm after the first layer's input norm
  has, the ``fused_add_rms_norm`` CUDA op, which is not batch-invariant in 0.24: see
  :func:`enable_batch_invariant_mode`), ``SiluAndMul`` the ``silu_and_mul`` CUDA op, attention with one KV split
  (``num_splits=1``, no cascade attention) but a tile that follows the step's longest query, which is not
  batch-invariant either for head_dim 64 (:data:`EXACT_MIN_QUERY_LEN`; :func:`enable_batch_invariant_mode` fixes
  it).

The engine runs in the training process (:mod:`megarl.rollout.vllm_engine`), so the overrides of the first half
act on the trainer's forward too once :func:`enable_batch_invariant_mode` has run (it runs them itself, before
the trainer's first matmul, so that cuBLAS reads its workspace setting). The second half is not in torch's
dispatcher: :func:`vllm_kernels` routes megatron's linear layers, RMSNorm modules, SwiGLU activations and core
attention (local layer spec, TP = 1) through the same functions for the duration of a forward-only pass, as
TorchTitan's ``deterministic_vllm_rl`` does with its own model. RoPE is vLLM's CUDA op (``csrc/pos_encoding_kernels.cu``), not a batch-invariant kernel, but it rounds
otherwise than megatron's torch rotation; :func:`vllm_rotary` computes what it computes and :func:`vllm_kernels`
puts it in megatron's attention. What stays different (prefill against decode over a paged KV cache) is listed
in docs/DESIGN.md; the GPU test (tests/test_gpu_exact.py) measures it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import torch

# The variables of vLLM's batch-invariant mode that must be set before cuBLAS is first used in the process.
BATCH_INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}

_ENABLED = False  # enable_batch_invariant_mode ran (batch_invariant_mode)
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]
RotaryFn = Callable[..., torch.Tensor]  # megatron's apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, ...)
ActivationFn = Callable[[torch.Tensor], torch.Tensor]  # [..., 2 f] (gate, up) -> [..., f]


def enable_batch_invariant_mode() -> bool:
    """Put this process in vLLM's batch-invariant mode (the overrides of the module docstring) where a GPU is
    there (the trainer calls it for ``rollout.exact`` with ``rollout.engine=vllm``), with vLLM's norms that take
    the residual pinned to the add then its row-wise Triton kernel (:func:`residual_then_norm`; the comment in
    the body says why) and its FlashAttention calls held to one tile (:func:`fixed_attention_tile`); a no-op on
    the CPU (returns False), where the old-log-prob pass is made batch-invariant
    by running each sample alone (:meth:`megarl.workers.engine.MegatronWorker.forward_response_frame`).

    Returns:
        Whether the mode is on.

    Raises:
        ImportError: a GPU but no vLLM (``rollout.exact`` with ``rollout.engine=vllm`` needs it; the preflight checks).
    """
    global _ENABLED
    if not torch.cuda.is_available():
        return False
    os.environ.update(BATCH_INVARIANT_ENV)
    from vllm.model_executor.layers import layernorm
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()
    # vLLM 0.24 (built 2026-06-29) runs a norm handed the residual on its fused_add_rms_norm CUDA op, whose block
    # size, and so the order of its sum of squares, depends on the step's token count (1024 threads under 256
    # tokens, 256 from there; vLLM issue #48271, fixed after 0.24 by #48391): a prompt prefilled among others and
    # the same tokens decoded alone normalise to other bits wherever hidden_size > 256. The add, then the
    # row-wise Triton kernel, makes every norm of the engine independent of the batch (vLLM's own path before
    # #40413; ~2% of its latency there), and the trainer's exact pass calls the same kernel.
    if not getattr(layernorm.rms_norm_batch_invariant, "adds_the_residual_first", False):
        layernorm.rms_norm_batch_invariant = residual_then_norm(layernorm.rms_norm_batch_invariant)
    from vllm.v1.attention.backends import flash_attn

    # FlashAttention 3 picks its tile from the call's max_seqlen_q: one of its KV-tile widths for a step of
    # short queries (decode), another for prefill (EXACT_MIN_QUERY_LEN says which and why); every call of the
    # engine's FLASH_ATTN backend and of the exact pass then runs the same tile.
    attention = getattr(flash_attn, "flash_attn_varlen_func", None)  # None where vLLM has no FlashAttention here
    if attention is not None and not getattr(attention, "fixes_the_tile", False):
        flash_attn.flash_attn_varlen_func = fixed_attention_tile(attention)
    _ENABLED = True
    return True


# The least max_seqlen_q the exact mode passes to FlashAttention 3. Read in vllm-flash-attention (hopper/
# flash_api.cpp, heuristics.h, tile_size.h; the same since 2026-02, so in vLLM 0.24): FA3 takes its tile
# (kBlockM x kBlockN) from the call's max_seqlen_q, not from each sequence. With max_seqlen_q x (query heads per
# KV head) <= 64 it runs one MMA warp group (`use_one_mma_wg`: for head_dim 64 a 64 x 192 tile), and with
# max_seqlen_q == 1 it drops the causal flag for head_dim <= 64 or > 128; a causal prefill of head_dim 64 runs
# 192 x 128. kBlockN is where the online softmax rescales and rounds P to bf16, so a query over more than 128
# keys comes out in other bits in a decode step (192) than in a prefill step or the trainer's pass (128): vLLM's
# batch-invariant mode is not invariant there (head_dim 64: SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B; for head_dim
# 128 both tiles are 128 wide over a paged cache). Measured 2026-12-07 on an H100: SmolLM2-135M on GSM8K (prompts
# of ~100-200 tokens, 256 new) with rollout.exact had ~0.0001 of its tokens equal, against 1.0 for sequences
# under 128 tokens. A floor of 65 keeps every call causal and off the one-warp-group tile, whatever the heads.
EXACT_MIN_QUERY_LEN = 65


def fixed_attention_tile(attention: Callable[..., object]) -> Callable[..., object]:
    """``flash_attn_varlen_func`` (vLLM's, ``vllm/vllm_flash_attn``) with ``max_seqlen_q`` raised to at least
    :data:`EXACT_MIN_QUERY_LEN`: a bound on the queries' length, which FA3 reads only to size its grid and pick
    its tile, so each query row is computed as in a prefill whatever else the step holds (the comment at
    :data:`EXACT_MIN_QUERY_LEN`). :func:`enable_batch_invariant_mode` puts it in vLLM's FLASH_ATTN backend; the
    exact pass's attention (:func:`_vllm_attention`) calls vLLM's function through it."""
    def with_fixed_tile(*args, **kwargs):
        if "max_seqlen_q" in kwargs:
            kwargs["max_seqlen_q"] = max(int(kwargs["max_seqlen_q"]), EXACT_MIN_QUERY_LEN)
        elif len(args) > 3:  # (q, k, v, max_seqlen_q, ...)
            args = (*args[:3], max(int(args[3]), EXACT_MIN_QUERY_LEN), *args[4:])
        return attention(*args, **kwargs)
    with_fixed_tile.fixes_the_tile = True
    return with_fixed_tile


def residual_then_norm(norm: Callable[..., torch.Tensor]) -> Callable[..., "torch.Tensor | tuple"]:
    """``norm(x, weight, eps)`` extended to vLLM's ``rms_norm_batch_invariant(x, weight, eps, residual=None)``
    contract: with a ``residual`` (``x``'s shape and dtype) it returns ``(norm(x + residual), x + residual)``, the
    sum rounded to ``x``'s dtype as vLLM's fused op rounds it; without, ``norm(x)``.
    (:func:`enable_batch_invariant_mode` puts it in vLLM's RMSNorm.)"""
    def norm_with_residual(x, weight, eps=1e-6, residual=None):
        if residual is None:
            return norm(x, weight, eps)
        total = x + residual
        return norm(total, weight, eps), total
    norm_with_residual.adds_the_residual_first = True
    return norm_with_residual


def batch_invariant_mode() -> bool:
    """Whether :func:`enable_batch_invariant_mode` put this process in vLLM's mode (a GPU run with
    ``rollout.engine=vllm``): the exact pass then runs vLLM's kernels (:func:`vllm_kernels`, :func:`vllm_logprobs`)."""
    return _ENABLED


def vllm_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, temperature: float
                  ) -> torch.Tensor:
    """Each label's log-prob as vLLM 0.24's V1 sampler computes the processed log-probs
    (``vllm/v1/sample/sampler.py``): the logits cut to the real vocab, in float32, divided by the temperature,
    ``log_softmax(dim=-1, dtype=float32)`` (in batch-invariant mode the Triton kernel that vLLM's ``torch.library``
    override puts behind it), then the label's entry. (The V2 runner's sampler computes the same figure with a
    Triton kernel of its own, ``vllm/v1/worker/gpu/sample/logprob.py``: one row a program, max then log-sum-exp
    over blocks of 1024; so ``rollout.exact`` runs vLLM on V1, :meth:`megarl.rollout.vllm_engine.VLLMSettings.
    environment`.)

    Args:
        logits: ``[b, s, v]`` (TP = 1: the padded vocab whole), any float dtype.
        labels: ``[b, s]`` int64 in ``[0, vocab_size)``.
        vocab_size: the real vocab (the padding columns are cut off, as vLLM's logits processor does).
        temperature: > 0.

    Returns:
        ``[b, s]`` float32.
    """
    z = logits[..., :vocab_size].float()
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1, dtype=torch.float32).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


# The float32 logits ([rows, tokens, vocab] x 4 bytes) one micro-batch of the exact pass holds on a GPU
# (MegatronWorker._exact_micro_batches): vllm_logprobs makes two more of that size, the bf16 logits half of it.
EXACT_LOGIT_BYTES = 2 * 2**30

EXACT_KV_BLOCK_SIZE = 16  # the KV cache's page, in tokens, of an exact engine (vLLM's default; llm_kwargs pins it)


def paged_kv(k: torch.Tensor, v: torch.Tensor, block_size: int = EXACT_KV_BLOCK_SIZE
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's keys and values ``[s, kv_heads, d]`` laid out as vLLM's FLASH_ATTN backend holds its KV
    cache: pages ``[ceil(s / block_size), block_size, kv_heads, d]`` (the last one zero-padded), with the block
    table ``[1, pages]`` int32 (page ``i`` is block ``i``) and the sequence's length ``[1]`` int32
    (``seqused_k``)."""
    s, pages = k.shape[0], -(-k.shape[0] // block_size)

    def cache(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(pages * block_size, *x.shape[1:])
        out[:s] = x
        return out.view(pages, block_size, *x.shape[1:])

    table = torch.arange(pages, dtype=torch.int32, device=k.device).unsqueeze(0)
    return cache(k), cache(v), table, torch.tensor([s], dtype=torch.int32, device=k.device)


def _vllm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One sequence's causal attention ``[s, heads, d]`` (keys and values ``[s, kv_heads, d]``) on the kernel of
    vLLM's FLASH_ATTN backend as its batch-invariant mode calls it (``vllm/v1/attention/backends/flash_attn.py``,
    ``FlashAttentionImpl.forward``): the keys and values read from a paged cache of ``EXACT_KV_BLOCK_SIZE``-token
    pages through a block table (:func:`paged_kv`; FlashAttention 3 picks its tiles and packs GQA heads by whether
    the KV is paged), one KV split, the FlashAttention version vLLM picks, and the tile of a prefill
    (:func:`fixed_attention_tile`), which the engine then runs for every step."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    s = q.shape[0]
    k_cache, v_cache, table, used = paged_kv(k, v)
    cu = torch.tensor([0, s], dtype=torch.int32, device=q.device)
    return fixed_attention_tile(flash_attn_varlen_func)(
        q.contiguous(), k_cache, v_cache, max_seqlen_q=s, cu_seqlens_q=cu, max_seqlen_k=s, seqused_k=used,
        block_table=table, softmax_scale=scale, causal=True, num_splits=1,
        fa_version=get_flash_attn_version(head_size=q.shape[-1]))


def vllm_rotary(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens: torch.Tensor | None = None,
                mscale: float = 1.0, cp_group=None, mla_rotary_interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding as vLLM 0.24's ``rotary_embedding`` CUDA op computes it, in the signature of
    megatron-core's ``apply_rotary_pos_emb`` (which :func:`vllm_kernels` replaces).

    vLLM (``RotaryEmbedding.forward_cuda``, ``csrc/pos_encoding_kernels.cu``, NeoX style) keeps a cos/sin cache
    computed in float32 on the GPU and cast to the query's dtype, and per pair ``(x, y)`` of a head's halves writes
    ``x cos - y sin`` and ``y cos + x sin`` computed in float32 and rounded once to the query's dtype. megatron's
    unfused rotation rounds each product and the sum to bf16, so about one element in ten ends a bf16 step
    apart. Here: ``cos(freqs)`` and ``sin(freqs)`` in float32, rounded to ``t``'s dtype, then the rotation in float32
    (the products of two bf16 values are exact in float32, so the one rounding of the sum is the kernel's whatever
    it fuses) and one rounding to ``t``'s dtype.

    Args:
        t: ``[s, b, heads, d]`` queries or keys, any float dtype; the first ``freqs.shape[-1]`` channels rotate.
        freqs: ``[s, 1, 1, rot]`` float32 angles, megatron's ``RotaryEmbedding`` output (each half the same).
        config, cp_group: megatron's; unused.
        cu_seqlens, mscale, mla_rotary_interleaved: must be None, 1.0 and False.

    Returns:
        ``t``'s shape and dtype.

    Raises:
        ValueError: packed sequences (``cu_seqlens``), a RoPE scale (``mscale``, YaRN), interleaved (GPT-J or MLA)
            rotation: what vLLM's NeoX kernel does not compute this way.
    """
    if cu_seqlens is not None or mscale != 1.0 or mla_rotary_interleaved or getattr(config, "rotary_interleaved",
                                                                                      False):
        raise ValueError("vllm_rotary: exact RoPE covers NeoX-style rotation of unpacked rows without a scale")
    rot = freqs.shape[-1]
    x, rest = t[..., :rot].float(), t[..., rot:]
    cos, sin = (f(freqs).to(t.dtype).float() for f in (torch.cos, torch.sin))
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(t.dtype), rest), dim=-1)


def _vllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``[..., 2 f]`` (gate rows first, then up) -> ``[..., f]`` on vLLM's ``silu_and_mul`` CUDA op, what
    its ``SiluAndMul`` (Llama's and Qwen2's MLP) runs: ``bf16(silu(g)) * u`` with vLLM's own ``expf``."""
    from vllm import _custom_ops  # noqa: F401  (loads torch.ops._C)

    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    torch.ops._C.silu_and_mul(out, x.contiguous())
    return out


def _vllm_functions() -> tuple[LinearFn, NormFn, ActivationFn, AttentionFn]:
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant

    return linear_batch_invariant, rms_norm_batch_invariant, _vllm_silu_and_mul, _vllm_attention


@contextlib.contextmanager
def vllm_kernels(modules: list[torch.nn.Module], linear: LinearFn | None = None, rms_norm: NormFn | None = None,
                 silu_and_mul: ActivationFn | None = None, attention: AttentionFn | None = None,
                 rotary: RotaryFn = vllm_rotary) -> Iterator[int]:
    """Within the block, every megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` of ``modules`` computes
    ``linear(x, weight, bias)``, every ``torch.nn.RMSNorm`` ``rms_norm(x, weight, eps)`` (megatron adds the
    residual first, rounded to bf16 as vLLM adds it), every dense SwiGLU ``MLP`` its activation
    ``silu_and_mul(x)``, every :class:`~megarl.kernels.attention.SDPAttention` (causal, no window, not packed)
    ``attention(q, k, v, scale)`` one sequence at a time, and megatron's attention rotates queries and keys with
    ``rotary``: vLLM's ``linear_batch_invariant``, ``rms_norm_batch_invariant``, ``silu_and_mul``, its
    FlashAttention with one KV split and its RoPE (:func:`vllm_rotary`) by default (module docstring). For
    forward-only passes of a TP = 1 model (no gradient flows through the replaced forwards).

    Args:
        modules: the model chunks.
        linear / rms_norm / silu_and_mul / attention: the functions (tests pass torch ones; None: vLLM's).
        rotary: in place of ``megatron.core.transformer.attention.apply_rotary_pos_emb`` (the module's name,
            process-wide, for the block).

    Yields:
        How many modules were rerouted.

    Raises:
        ValueError: a linear layer split over TP ranks (``rollout.exact`` refuses ``actor.parallel.tp > 1``); in
            the forward, an MLP other than a bias-free SwiGLU or attention other than causal over unpacked rows.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    from megarl.kernels.attention import SDPAttention

    if None in (linear, rms_norm, silu_and_mul, attention):
        defaults = _vllm_functions()
        linear, rms_norm, silu_and_mul, attention = (given or default for given, default in zip(
            (linear, rms_norm, silu_and_mul, attention), defaults))
    patched: list[torch.nn.Module] = []

    def linear_forward(layer, x, weight=None, *args, **kwargs):  # weight: the tied embedding (output layer)
        bias = None if layer.skip_bias_add else layer.bias
        return (linear(x, layer.weight if weight is None else weight, bias),
                layer.bias if layer.skip_bias_add else None)

    def norm_forward(norm, x):
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, norm.weight, eps)

    def mlp_forward(mlp, hidden_states, per_token_scale=None, **kwargs):
        config = mlp.config
        swiglu = (config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
                  and config.activation_func_clamp_value is None and config.glu_linear_offset == 0.0)
        if not swiglu or per_token_scale is not None:
            raise ValueError("vllm_kernels: exact MLPs are SwiGLU (silu, gated, no clamp, offset or token scale)")
        intermediate, bias = mlp.linear_fc1(hidden_states)
        if bias is not None:
            raise ValueError("vllm_kernels: exact MLPs have no bias in linear_fc1")
        return mlp.linear_fc2(silu_and_mul(intermediate))

    def attention_forward(core, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                          packed_seq_params=None):
        plain = (packed_seq_params is None and attention_bias is None and attention_mask is None
                 and core.window_size is None and (attn_mask_type or core.attn_mask_type).name == "causal")
        if not plain:
            raise ValueError("vllm_kernels: exact attention covers causal attention of unpacked rows without a "
                             "window or mask")
        sq, b, heads, hn = query.shape  # [s, b, n, d], one sequence a row
        out = torch.stack([attention(query[:, i], key[:, i], value[:, i], core.softmax_scale) for i in range(b)], 1)
        return out.reshape(sq, b, heads * hn)

    from megatron.core.transformer import attention as megatron_attention

    megatrons_rotary = megatron_attention.apply_rotary_pos_emb
    try:
        megatron_attention.apply_rotary_pos_emb = rotary
        for chunk in modules:
            for m in chunk.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    if m.tp_group.size() != 1:
                        raise ValueError(f"vllm_kernels: {type(m).__name__} is split over {m.tp_group.size()} "
                                         "TP ranks; exact log-probs need TP = 1")
                    m.forward = linear_forward.__get__(m)
                elif isinstance(m, torch.nn.RMSNorm):
                    m.forward = norm_forward.__get__(m)
                elif isinstance(m, MLP):
                    m.forward = mlp_forward.__get__(m)
                elif isinstance(m, SDPAttention):
                    m.forward = attention_forward.__get__(m)
                else:
                    continue
                patched.append(m)
        yield len(patched)
    finally:
        megatron_attention.apply_rotary_pos_emb = megatrons_rotary
        for m in patched:
            del m.forward  # back to the class's forward
