"""Fast paths of megarl's training phase, each equal to a plain path it is tested against (tests/test_kernels.py,
tests/test_gpu_kernels.py) and selected by ``actor.kernels`` / ``critic.kernels``:

- :mod:`megarl.kernels.chunked_logprobs`: the output layer, per-token log-probs and entropy in chunks of tokens on
  vocab-parallel logits (Triton kernels of :mod:`megarl.kernels.triton_logprobs` on the GPU); plain path:
  ``GPTModel``'s logits + :func:`megarl.models.logprobs.vocab_parallel_logprobs`;
- :mod:`megarl.kernels.attention`: megatron-core's core attention on torch's ``scaled_dot_product_attention``; plain
  path: megatron-core's ``DotProductAttention``.
- :mod:`megarl.kernels.grouped_experts`: an MoE layer's routed experts as two grouped GEMMs (``actor.kernels.moe_experts
  =grouped``); plain path: megatron-core's ``SequentialMLP`` (tests/test_models_moe.py).
- :mod:`megarl.kernels.gated_delta_rule`: not a fast path but the CPU's: the gated delta rule and causal convolution
  megatron-core's ``GatedDeltaNet`` (Qwen3.5) calls, in torch, where flash-linear-attention's Triton kernels are
  absent (tests/test_kernels_gated_delta.py against transformers' references).
- :mod:`megarl.kernels.batch_invariant`: not a fast path but ``rollout.exact``'s: vLLM's batch-invariant mode for the
  process and its kernels in megatron's layers during the old-log-prob pass (tests/test_exact.py,
  tests/test_gpu_exact.py).

This package sits beside ``megarl.models`` in the import order: it imports torch, Triton and megatron-core only.

The modules live in the repository's top-level ``kernels/`` folder and are imported as ``megarl.kernels``, never
as ``kernels``: that is the import name of Hugging Face's ``kernels`` package, which transformers probes for.
A wheel installs the folder's modules as ``megarl/kernels/`` (the package-dir mapping in pyproject.toml); from a
source checkout or an editable install this file, which no wheel holds, points the package at the folder.
``kernels/`` has no ``__init__.py`` of its own, so that with the repository's root on ``sys.path`` a plain
``import kernels`` still finds Hugging Face's package (a regular package wins over a folder without one).
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "kernels")]  # the repository's kernels/ folder
