"""The per-rank work of ``megarl convert`` (HF directory or GGUF -> megarl/Megatron dist checkpoint) and
``megarl export`` (back), and the checks they make before any rank starts.

:func:`convert_rank` builds the Megatron model at the world's TP x PP (x VPP), each rank reading only the safetensors
slices it holds, and saves a layout-free dist checkpoint that records the source's own config. :func:`export_rank`
loads that checkpoint at TP=1 x PP=1 (megatron-core reshards on load), assembles the canonical tensors and
writes them with the source's config (:func:`export_config`) and generation config: the round trip reproduces
every HF tensor bit for bit when the dtype is kept, and both configs as they were. A LoRA actor's checkpoint (its
adapters and the base it names) exports as the merged model ``W + (alpha / r) B A`` (fp64, one rounding) and, in
its ``adapter/`` folder, the adapters in PEFT's format on that base (:mod:`megarl.models.peft`). :mod:`megarl.launch.convert` starts the ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def check_conversion(src: str | None, tp: int, pp: int, dtype: str | None, vpp: int = 1) -> None:
    """What :func:`convert_rank` needs, checked from the source's config alone (no weight is read).

    Raises:
        ValueError: an unknown ``dtype``. SpecError: unknown architecture, or a TP/PP/VPP that does not fit the
            model (naming ``--tp``/``--pp``/``--vpp`` and the sizes that would). FileNotFoundError: no such
            source. LayoutError: ``--vpp`` above 1 with ``--pp 1``.
    """
    from megarl.models.checkpoint import DTYPES, source_spec
    from megarl.models.hf_io import load_tokenizer
    from megarl.models.megatron import check_layout
    from megarl.models.spec import SpecError
    from megarl.parallel.mesh import ParallelLayout

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    spec, _, _ = source_spec(src)
    for flag, layout in (("--tp", ParallelLayout(tp=tp)), ("--pp", ParallelLayout(pp=pp)),
                         ("--vpp", _vpp_layout(pp, vpp))):
        try:
            check_layout(spec, layout)
        except SpecError as e:
            raise SpecError(f"{flag} {getattr(layout, flag[2:])}: {e}") from None
    try:
        load_tokenizer(src)
    except ValueError as e:  # the weights convert; training and evaluation need a tokenizer named then
        log.warning("converting without a tokenizer: %s", e)


def _vpp_layout(pp: int, vpp: int):
    """The layout whose ``--vpp`` :func:`check_conversion` checks against the model: ``pp x vpp`` virtual
    stages (``pp`` stages when ``vpp`` is 1, as ``--pp`` is checked already).

    Raises:
        LayoutError: ``--vpp`` above 1 with ``--pp 1``, naming both flags.
    """
    from megarl.parallel.mesh import LayoutError, ParallelLayout

    try:
        return ParallelLayout(pp=pp, vpp=vpp)
    except LayoutError as e:
        raise LayoutError(f"--vpp {vpp} --pp {pp}: {e}") from None


def convert_rank(rank: int, world: int, src: str | None, out: str, tp: int, pp: int, dtype_name: str | None,
                 vpp: int = 1) -> str:
    """One rank of a conversion world of ``tp * pp`` ranks (``torch.distributed`` initialised), each holding
    ``vpp`` model chunks; returns the checkpoint directory."""
    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.models.megatron import build_model_chunks, conversion_moe_experts
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    ckpt = open_hf_checkpoint(src)
    ckpt.check_complete()
    dtype = ck.DTYPES[dtype_name] if dtype_name else ckpt.dtype
    mesh = ParallelLayout(tp=tp, pp=pp, dp=1, vpp=vpp)
    initialize_model_parallel(mesh)
    model = build_model_chunks(ckpt.spec, mesh, params_dtype=dtype, init_weights=False,
                               moe_experts=conversion_moe_experts(ckpt.spec))
    ck.load_hf_weights(model, ckpt)
    return str(ck.save_model(out, model, tokenizer=str(ckpt.path), source=str(ckpt.path),
                             source_config=ckpt.hf_config, generation_config=ck.source_generation_config(src)))


def export_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an export: the source's config as it was (``eos_token_id: null`` stays null,
    ``sliding_window`` and every other field are kept), with the checkpoint's ``dtype``; checkpoints without a
    recorded source config give the spec's config.

    Raises:
        SpecError: the recorded source config describes other tensor shapes than the checkpoint holds.
    """
    from megarl.models.spec import FAMILIES, ModelSpec, SpecError

    spec = ModelSpec.from_hf_config(meta["hf_config"])
    cfg = dict(meta.get("source_config") or spec.to_hf_config().to_dict())
    if ModelSpec.from_hf_config(cfg).hf_tensor_shapes() != spec.hf_tensor_shapes():
        raise SpecError("the checkpoint's source_config describes another model than its hf_config")
    cfg.pop("_name_or_path", None)
    if not cfg.get("architectures"):  # GGUF metadata names no architecture class
        cfg["architectures"] = [FAMILIES[spec.family].hf_architecture]
    cfg["dtype"] = meta["dtype"]
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = meta["dtype"]
    return cfg


ADAPTER_FOLDER = "adapter"  # an export's PEFT adapter folder, for a LoRA checkpoint


def load_canonical(ckpt_dir: str, *, merged: bool = True) -> dict:
    """Every canonical (HF) tensor of a megarl checkpoint (saved at any TP x PP x VPP), loaded on this process as a
    TP=1 x PP=1 Megatron model replicated over all ranks of the initialised world (megatron-core reshards on
    load). A LoRA checkpoint: its base with the adapters merged in (``merged``), else the base and the adapters'
    canonical factors (:func:`megarl.models.layout_lora.lora_canonical_shapes`).

    Returns:
        canonical name -> tensor, in the checkpoint's dtype.

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a megarl checkpoint.
        SpecError: an MoE checkpoint written from Transformer Engine's layer spec, where TE does not import (its
            grouped experts are read by TE's spec only).
    """
    import torch.distributed as dist

    from megarl.models import checkpoint as ck
    from megarl.models.layout_lora import lora_canonical_shapes
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model, conversion_moe_experts
    from megarl.models.weights import assemble_canonical
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    meta = ck.read_meta(ckpt_dir)
    spec = ck.checkpoint_spec(ckpt_dir)
    lora = checkpoint_lora(ckpt_dir)
    mesh = ParallelLayout(dp=dist.get_world_size())
    initialize_model_parallel(mesh)
    use_te = spec.is_moe and ck.checkpoint_uses_te(ckpt_dir)  # dense: the local spec reads TE's keys
    experts = "sequential" if lora is not None and lora.experts else conversion_moe_experts(spec)  # alike on disk
    model = build_model(spec, mesh, params_dtype=ck.DTYPES[meta["dtype"]], init_weights=False, use_te=use_te,
                        lora=lora, moe_experts=experts)
    ck.load_model(ckpt_dir, model)
    shapes = {**spec.hf_tensor_shapes(), **(lora_canonical_shapes(spec, lora) if lora else {})}
    out = assemble_canonical(megatron_rank_tensors(spec, mesh, 0, 0, padded_vocab=model.vocab_size, use_te=use_te,
                                                   lora=lora, moe_experts=experts),
                             dict(model.named_parameters()), shapes)
    return merge_adapters(spec, lora, out) if lora is not None and merged else out


def merge_adapters(spec, lora, canonical: dict) -> dict:
    """The canonical tensors of a LoRA model with its adapters merged in: ``W + (alpha / r) B A`` for every adapted
    weight (the reshard's merge on whole tensors, :func:`megarl.models.lora.apply_merges`: fp64, one rounding),
    the other base tensors as they are, no adapter factor."""
    from megarl.models.layout import hf_layout
    from megarl.models.layout_lora import lora_targets, with_lora_merge
    from megarl.models.lora import apply_merges

    merges = with_lora_merge(hf_layout(spec, [0]), lora).merges[0]
    by_weight = {m.tensor: m for m in merges}
    out = {n: canonical[n].clone() for n in spec.hf_tensor_shapes()}
    for w, (a, b) in lora_targets(spec, lora).items():
        out[by_weight[w].a_aux], out[by_weight[w].b_aux] = canonical[a], canonical[b]
    apply_merges(merges, out)
    return {n: out[n] for n in spec.hf_tensor_shapes()}


def checkpoint_lora(ckpt_dir: str):
    """The :class:`~megarl.models.lora.LoRASpec` of a LoRA actor's checkpoint, or None."""
    from megarl.models import checkpoint as ck
    from megarl.models.lora import LoRASpec

    meta = ck.read_meta(ckpt_dir).get("lora")
    return LoRASpec(**{k: v for k, v in meta.items() if k != "base"}) if meta else None


def export_rank(rank: int, world: int, ckpt_dir: str, out: str) -> str:
    """The one rank of an export world; returns the Hugging Face directory (a LoRA checkpoint's: the merged model,
    and the PEFT adapter in its ``adapter/`` folder)."""
    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import save_hf_checkpoint

    meta = ck.read_meta(ckpt_dir)
    spec, lora = ck.checkpoint_spec(ckpt_dir), checkpoint_lora(ckpt_dir)
    canonical = load_canonical(ckpt_dir, merged=False)
    path = save_hf_checkpoint(out, spec, merge_adapters(spec, lora, canonical) if lora else canonical,
                              config=export_config(meta), generation_config=meta.get("generation_config"))
    if lora is not None:  # beside the merged model (save_hf_checkpoint replaced the folder)
        from megarl.models.peft import save_peft_adapter

        save_peft_adapter(path / ADAPTER_FOLDER, spec, lora, canonical, adapter_base(meta["lora"]["base"]))
    _copy_tokenizer(meta.get("tokenizer"), path)
    return str(path)


def adapter_base(base: str | None) -> str:
    """The base model a LoRA checkpoint names (``lora.base``; None: the CPU default) as PEFT's
    ``base_model_name_or_path``: its real, absolute path (never "default", which peft takes for a hub name).
    A GGUF base (the CPU default) is a file that ``AutoModelForCausalLM.from_pretrained`` loads only with
    ``gguf_file=``: said in a warning."""
    from megarl.models.hf_io import resolve_model_path

    path = resolve_model_path(base)
    if path.suffix == ".gguf":
        log.warning("the LoRA adapter's base is the GGUF file %s: peft's AutoPeftModelForCausalLM cannot load it by "
                    "name; load it with AutoModelForCausalLM.from_pretrained(%r, gguf_file=%r), then "
                    "PeftModel.from_pretrained(model, <export>/adapter)", path, str(path.parent), path.name)
    return str(path)


def _copy_tokenizer(source: str | None, out_dir: Path) -> None:
    """Save the tokenizer of the original model beside the exported weights, where one is known."""
    if not source:
        return
    try:
        from megarl.models.hf_io import load_tokenizer

        load_tokenizer(source).save_pretrained(str(out_dir))
    except (OSError, ValueError) as e:
        log.warning("exported weights without a tokenizer: could not load one from %s (%s)", source, e)
