"""Running a Megatron model over micro-batches with megatron-core's ``forward_backward_func``.

One entry point serves inference (log-probs, values) and training: the pipeline schedule (1F1B when PP > 1,
interleaved 1F1B over model chunks with VPP, no pipelining otherwise) calls the model on each micro-batch and, on the last stage, ``output_fn`` on its
output. Sequences are right-padded; no attention mask is passed: attention is causal and padding sits after
every real token. A packed micro-batch (one row ``[1, T]`` of sequences back to back, with ``cu_seqlens``:
:func:`megarl.workers.packing.pack_rows`) goes to the model with megatron's ``PackedSeqParams``
(:func:`packed_seq_params`), so that attention stays within each sequence. With PP > 1 every
micro-batch of a call has the same ``[b, s]`` (the schedule's p2p buffers have one shape); without pipelining
each micro-batch may have its own (micro-batches by token count, :mod:`megarl.workers.packing`; megatron's
``forward_backward_no_pipelining`` ignores ``seq_length`` and ``micro_batch_size``).

With context parallelism (CP > 1) the model sees this CP rank's share of each sequence
(:func:`megarl.kernels.context_parallel.split_for_cp_rank` of ``input_ids`` and positions, ``s`` a multiple of
``2 * cp``); ``output_fn`` receives the whole micro-batch and the output of those tokens
(``[b, s / cp, ...]``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from megarl.kernels.context_parallel import split_for_cp_rank

OutputFn = Callable[[Mapping[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def run_microbatches(model: torch.nn.Module | list[torch.nn.Module], micro_batches: list[Mapping[str, torch.Tensor]],
                     output_fn: OutputFn, *, forward_only: bool,
                     model_kwargs: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Forward (and backward unless ``forward_only``) ``model`` over ``micro_batches``.

    Args:
        model: this rank's stage (a ``GPTModel``, possibly DDP-wrapped), in train or eval mode as wanted; with
            VPP the list of its chunks (:func:`megarl.models.megatron.build_model_chunks`), which megatron's
            interleaved schedule runs, each chunk reading every micro-batch from its own iterator.
        micro_batches: dicts with at least ``input_ids`` ``[b, s]`` int64 (same ``b`` and ``s`` for all when
            PP > 1), packed ones (``b = 1``) also ``position_ids [1, s]`` and ``cu_seqlens``; every stage
            receives the whole dict, so the last stage can read labels, masks and advantages. With
            ``prompt_lens`` and ``response_lens`` an MoE model gets megatron's ``padding_mask`` of the positions
            without a real token (:func:`megarl.models.moe_router.padding_mask`), which its routers leave out of
            the load-balancing loss and z-loss.
        output_fn: ``(micro_batch, output) -> (loss, metrics)``, run on the last pipeline stage, where
            ``output`` is the model output ``[b, s, v/tp]`` (actor) or ``[b, s, 1]`` (critic), or what an
            ``output_processor`` in ``model_kwargs`` returns (e.g. :class:`megarl.kernels.chunked_logprobs.LogprobOutput`'s
            ``(logprobs, entropy)``). For training,
            ``loss`` is backpropagated after megatron divides it by ``len(micro_batches)`` (and multiplies it
            by CP: DDP averages gradients over DP x CP); ``metrics`` is collected.
        model_kwargs: extra keyword arguments of every model call (``GPTModel.forward``'s); with an
            ``output_processor``, the micro-batch is its ``output_processor_context``.

    Returns:
        The ``metrics`` dicts of every micro-batch, in order, on the last pipeline stage; ``[]`` elsewhere.

    Raises:
        ValueError: micro-batches of different shapes with PP > 1.
        LayoutError: with VPP, a number of micro-batches the interleaved schedule rejects
            (:meth:`~megarl.parallel.mesh.ParallelLayout.check_num_microbatches`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.moe_router import padding_mask
    from megarl.parallel.mesh import ParallelLayout

    if not micro_batches:
        return []
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    pp = ps.get_pipeline_model_parallel_world_size()
    if len(chunks) > 1:
        ParallelLayout(pp=pp, vpp=len(chunks)).check_num_microbatches(len(micro_batches))
    b, s = micro_batches[0]["input_ids"].shape
    if pp > 1:
        for i, mb in enumerate(micro_batches):
            if tuple(mb["input_ids"].shape) != (b, s):
                raise ValueError(f"micro-batch {i} has shape {tuple(mb['input_ids'].shape)}, expected {(b, s)} "
                                 "(the pipeline schedule needs one shape)")

    cp_group = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None

    def forward_step(data_iterator, stage):
        mb = next(data_iterator)
        kwargs = dict(model_kwargs or {})
        input_ids = mb["input_ids"]
        if "cu_seqlens" in mb:  # packed: one row of sequences back to back (no CP: the config refuses both)
            position_ids = mb["position_ids"]
            kwargs["packed_seq_params"] = packed_seq_params(mb["cu_seqlens"], input_ids.shape[1])
        else:
            rows, width = input_ids.shape
            position_ids = torch.arange(width, device=input_ids.device).unsqueeze(0).expand(rows, width)
            if cp_group is not None:
                input_ids, position_ids = (split_for_cp_rank(t, 1, cp_group) for t in (input_ids, position_ids))
        if "response_lens" in mb and stage.config.num_moe_experts:
            kwargs["padding_mask"] = _stage_padding_mask(stage, padding_mask(mb, mb["input_ids"].shape[1]))
        if "output_processor" in kwargs:
            kwargs["output_processor_context"] = mb  # e.g. the micro-batch's logit_positions (LogprobOutput)
        output = stage(input_ids, position_ids, None, **kwargs)

        def loss_func(out):
            loss, metrics = output_fn(mb, out)
            return loss, metrics

        return output, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
    )


def _stage_padding_mask(stage, mask: torch.Tensor) -> torch.Tensor:
    """``mask [b, s]`` for ``stage``: megatron's first stage splits it over TP under sequence parallelism
    itself, a later stage (whose MoE layers see ``s / tp`` tokens) is given this TP rank's share."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    if not stage.config.sequence_parallel or get_attr_wrapped_model(stage, "pre_process"):
        return mask
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return mask.chunk(tp, dim=1)[rank].contiguous()


def packed_seq_params(cu_seqlens: torch.Tensor, width: int):
    """megatron's ``PackedSeqParams`` of a packed row of ``width`` tokens whose segments start at
    ``cu_seqlens [n + 1]`` int32 (:func:`megarl.workers.packing.pack_rows`), in the ``sbhd`` layout.

    The row keeps megatron's ``[s, b=1, h]`` activations, and megatron applies RoPE over the row's own positions
    ``0 .. width - 1`` in one vectorised op (``max_seqlen`` = ``width``) instead of its THD path, which rotates one
    sequence at a time and synchronises with the host twice per layer. The two are the same attention: RoPE
    scores depend only on the distance between a query and a key, which is the same within a sequence whether
    its positions start at 0 or at its offset, and :class:`megarl.kernels.attention.SDPAttention` reads the sequences
    from ``cu_seqlens`` and never attends across them.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=width, max_seqlen_kv=width)


def broadcast_from_last_stage(tensors: dict[str, torch.Tensor] | None, shapes: dict[str, tuple[int, ...]],
                              dtype: torch.dtype = torch.float32, device=None) -> dict[str, torch.Tensor]:
    """Give every pipeline stage the tensors computed on the last stage (e.g. log-probs, values).

    Args:
        tensors: on the last stage, name -> tensor; ignored elsewhere.
        shapes: name -> shape, known on every stage.

    Returns:
        name -> tensor on every rank of the pipeline group.
    """
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return dict(tensors)
    last = ps.is_pipeline_last_stage()
    src = ps.get_pipeline_model_parallel_last_rank()
    group = ps.get_pipeline_model_parallel_group()
    out = {}
    for name, shape in shapes.items():
        t = tensors[name].to(dtype).contiguous() if last else torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(t, src=src, group=group)
        out[name] = t
    return out
