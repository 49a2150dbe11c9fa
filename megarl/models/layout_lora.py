"""LoRA adapters in the layout algebra of :mod:`megarl.models.layout`: the adapter factors as canonical tensors,
the factors a local tensor holds, engine layouts that merge them, and the adapter-only layout.

LoRA adapters (:mod:`megarl.models.lora`) are canonical tensors too (:func:`lora_targets`): each adapted weight ``W``
(``[rows, cols]``) has ``B`` ``[rows, r]`` named ``<W>.lora_B.weight`` and ``A`` ``[r, cols]``, shared by the
projections that megatron fuses into one layer (``self_attn.qkv_proj.lora_A.weight`` for q, k and v,
``mlp.gate_up_proj.lora_A.weight`` for gate and up; ``<W>.lora_A.weight`` otherwise, Phi-3's fused ``qkv_proj``
and ``gate_up_proj`` included, which PEFT adapts as they are). A local tensor's adapter
factors follow its blocks: the ``B`` side holds, for each block of ``W`` rows, those rows of ``B``; the ``A`` side,
for each block's columns, those columns of ``A`` (:func:`adapter_tensors`). That describes megatron's adapters
(``lora_b`` split like a column-parallel weight's rows, ``lora_a`` like a row-parallel weight's columns) and, in a
merged destination (:func:`with_lora_merge`), the factors each engine tensor needs to compute its own
``W + (alpha / r) B A`` in place.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from megarl.models import gpt_oss
from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.layout import Block, Layout, LocalTensor, shape_key, whole
from megarl.models.lora import LoRASpec, Merge
from megarl.models.spec import FAMILIES, ModelSpec, SpecError


def lora_targets(spec: ModelSpec, lora: LoRASpec) -> dict[str, tuple[str, str]]:
    """Every weight that ``lora`` adapts, by canonical name, with its adapter's canonical ``(A, B)`` names (module
    docstring): q/k/v share ``self_attn.qkv_proj.lora_A.weight``, gate/up ``<mlp>.gate_up_proj.lora_A.weight``
    (one per expert, and the shared expert's), ``o_proj`` / ``down_proj`` have their own, as have Phi-3's fused
    ``qkv_proj`` and ``gate_up_proj`` (whose ``A`` has the same name).

    Raises:
        SpecError: ``lora.experts`` on a dense model.
    """
    if lora.experts and not spec.is_moe:
        raise SpecError(f"LoRA on the experts (experts=true) needs a mixture-of-experts model; a {spec.family} "
                        "model has none")
    out: dict[str, tuple[str, str]] = {}
    want = set(lora.target_modules)

    def own(w: str) -> None:
        out[w] = (w.removesuffix("weight") + "lora_A.weight", w.removesuffix("weight") + "lora_B.weight")

    def shared(ws: tuple[str, ...], a_name: str) -> None:
        for w in ws:
            out[w] = (a_name, w.removesuffix("weight") + "lora_B.weight")

    def mlp(prefix: str, gate: str, up: str, down: str) -> None:
        if "linear_fc1" in want:
            shared((gate, up), prefix + "gate_up_proj.lora_A.weight")
        if "linear_fc2" in want:
            own(down)

    for i in range(spec.num_layers):
        p = f"model.layers.{i}.self_attn."
        m = f"model.layers.{i}.mlp."
        if spec.fused_qkv_mlp:  # Phi-3: the fused projections are the adapted weights themselves
            for module, w in (("linear_qkv", p + "qkv_proj.weight"), ("linear_proj", p + "o_proj.weight"),
                              ("linear_fc1", m + "gate_up_proj.weight"), ("linear_fc2", m + "down_proj.weight")):
                if module in want:
                    own(w)
            continue
        if "linear_qkv" in want:
            shared(tuple(p + f"{x}_proj.weight" for x in "qkv"), p + "qkv_proj.lora_A.weight")
        if "linear_proj" in want:
            own(p + "o_proj.weight")
        if not is_moe_layer(spec, i):  # a dense model's, or GLM-4.5's dense first layers
            mlp(m, m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight")
            continue
        if spec.shared_expert_ffn_hidden_size:  # Qwen2-MoE's shared_expert, GLM-4.5's shared_experts
            s = m + ("shared_experts." if spec.deepseek_moe is not None else "shared_expert.")
            mlp(s, s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight")
        if lora.experts and FAMILIES[spec.family].gpt_oss:  # gate and up in one canonical tensor: adapted whole
            for e in range(spec.num_experts):
                for module, w in zip(("linear_fc1", "linear_fc2"), gpt_oss.expert_tensors(spec, i, e)):
                    if module in want:
                        own(w)
        elif lora.experts:
            for e in range(spec.num_experts):
                gate, up, down = spec.expert_names(i, e)
                mlp(gate.rsplit(".", 2)[0] + ".", gate, up, down)
    return out


def lora_canonical_shapes(spec: ModelSpec, lora: LoRASpec) -> dict[str, tuple[int, int]]:
    """Canonical name -> shape of every adapter factor: ``A`` ``[r, cols]`` and ``B`` ``[rows, r]`` of each
    adapted weight ``[rows, cols]`` (:func:`lora_targets`)."""
    shapes = spec.hf_tensor_shapes()
    out: dict[str, tuple[int, int]] = {}
    for w, (a, b) in lora_targets(spec, lora).items():
        rows, cols = shapes[w]
        out[a] = (lora.rank, cols)
        out[b] = (rows, lora.rank)
    return out


def parameter_counts(spec: ModelSpec, lora: LoRASpec | None) -> dict[str, int]:
    """``{"model", "adapters", "trainable"}``: the base model's parameters, the LoRA adapters' (0 without), and
    those an update trains (the adapters with LoRA, else every weight), counted once over any layout."""
    adapters = sum(math.prod(s) for s in lora_canonical_shapes(spec, lora).values()) if lora else 0
    return {"model": spec.num_params(), "adapters": adapters, "trainable": adapters if lora else spec.num_params()}


def adapter_tensors(lt: LocalTensor, targets: Mapping[str, tuple[str, str]], rank: int, a_name: str, b_name: str
                    ) -> tuple[LocalTensor, LocalTensor, list[Merge]]:
    """The adapter factors that a local tensor made of adapted weights' blocks holds (module docstring).

    Returns:
        ``(A side, B side, merges)``: ``a_name`` ``[slots * rank, cols]`` holding each block's columns of its
        weight's ``A`` (one slot of ``rank`` rows per distinct ``A``), ``b_name`` ``[rows, rank]`` holding each
        block's rows of its ``B``, and one :class:`Merge` per block (scale 1: :func:`with_lora_merge` sets it).
        Identical blocks (q, k and v's shared ``A``) are listed once.

    Raises:
        SpecError: ``lt`` is not 2-D, or two blocks of different adapted weights share rows.
    """
    if len(lt.shape) != 2:
        raise SpecError(f"LoRA: local tensor {lt.name!r} {lt.shape} is not a 2-D weight")
    slots: dict[str, int] = {}
    a_blocks: dict[tuple, Block] = {}
    b_blocks: dict[tuple, Block] = {}
    merges: list[Merge] = []
    for blk in lt.blocks:
        if blk.name not in targets:
            continue
        a, b = targets[blk.name]
        slot = slots.setdefault(a, len(slots))
        (r0, c0), (d0, d1), (n0, n1) = blk.src, blk.dst, blk.size
        ab = Block(a, (0, c0), (slot * rank, d1), (rank, n1))
        bb = Block(b, (r0, 0), (d0, 0), (n0, rank))
        a_blocks.setdefault((ab.src, ab.dst, ab.name), ab)
        if any(o.dst[0] < d0 + n0 and d0 < o.dst[0] + o.size[0] for o in b_blocks.values()):
            raise SpecError(f"LoRA: blocks of {lt.name!r} share rows; its B rows cannot be laid out")
        b_blocks[(bb.src, bb.dst, bb.name)] = bb
        merges.append(Merge(lt.name, b_name, a_name, (d0, n0), (d1, n1), slot * rank, rank, 1.0))
    return (LocalTensor(a_name, (len(slots) * rank, lt.shape[1]), tuple(a_blocks.values())),
            LocalTensor(b_name, (lt.shape[0], rank), tuple(b_blocks.values())), merges)


def with_lora_merge(dst: Layout, lora: LoRASpec) -> Layout:
    """``dst`` (an engine's layout) receiving merged weights ``W + (alpha / r) B A``: each local tensor made of
    adapted weights gets two auxiliary tensors (``<name>:lora_a``, ``<name>:lora_b``, :func:`adapter_tensors`)
    that the reshard fills with the rows of ``B`` and the columns of ``A`` its blocks need, besides its own
    ``W`` blocks, and the merges that then write it (:attr:`~megarl.models.layout.Layout.merges`, run by the
    executor). No rank receives more of the adapters than its own tensors' rows and columns (and a whole factor
    where its tensor is whole along it).

    Raises:
        SpecError: from :func:`lora_targets` / :func:`adapter_tensors`.
    """
    targets = lora_targets(dst.spec, lora)
    per_dict: dict[int, tuple[dict[str, LocalTensor], tuple[Merge, ...]]] = {}
    ranks, merges = {}, {}
    for g, tensors in dst.ranks.items():
        if id(tensors) not in per_dict:
            out, ops = dict(tensors), []
            for lt in tensors.values():
                if len(lt.shape) == 2 and any(b.name in targets for b in lt.blocks):
                    a, b, m = adapter_tensors(lt, targets, lora.rank, f"{lt.name}:lora_a", f"{lt.name}:lora_b")
                    out.update({a.name: a, b.name: b})
                    ops += [op._replace(scale=lora.scale) for op in m]
            per_dict[id(tensors)] = (out, tuple(ops))
        ranks[g], merges[g] = per_dict[id(tensors)]
    return Layout(dst.kind, dst.spec, {**dst.canonical, **lora_canonical_shapes(dst.spec, lora)}, ranks,
                  dst.key + ("lora-merged", lora), merges)


def adapter_layout(spec: ModelSpec, lora: LoRASpec, ranks: Iterable[int]) -> Layout:
    """Every rank in ``ranks`` holds every adapter factor whole under its canonical name (the adapter-only
    weight sync to vLLM, whose LoRA layers cut their own TP shards; the PEFT export)."""
    shapes = lora_canonical_shapes(spec, lora)
    tensors = {n: whole(n, s) for n, s in shapes.items()}
    ranks = tuple(ranks)
    return Layout("hf", spec, shapes, {g: tensors for g in ranks}, ("lora-adapters", shape_key(spec), ranks, lora))
