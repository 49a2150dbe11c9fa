"""Fast paths of megarl's training phase, each equal to a plain path it is tested against (tests/test_kernels.py,
tests/test_gpu_kernels.py) and selected by ``actor.kernels`` / ``critic.kernels``:

- :mod:`kernels.chunked_logprobs`: the output layer, per-token log-probs and entropy in chunks of tokens on
  vocab-parallel logits (Triton kernels of :mod:`kernels.triton_logprobs` on the GPU); plain path:
  ``GPTModel``'s logits + :func:`megarl.models.logprobs.vocab_parallel_logprobs`;
- :mod:`kernels.attention`: megatron-core's core attention on torch's ``scaled_dot_product_attention``; plain
  path: megatron-core's ``DotProductAttention``.
- :mod:`kernels.grouped_experts`: an MoE layer's routed experts as two grouped GEMMs (``actor.kernels.moe_experts
  =grouped``); plain path: megatron-core's ``SequentialMLP`` (tests/test_models_moe.py).

This package sits beside ``megarl.models`` in the import order: it imports torch, Triton and megatron-core only.
"""
