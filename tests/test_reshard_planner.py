"""The reshard planner, single process: coverage on hypothesis-generated models and layouts, replica
preference, caching, and the plan-time errors."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.models.layout import Block, Layout, LocalTensor, hf_layout
from megarl.models.layout_megatron import megatron_layout
from megarl.models.layout_vllm import vllm_layout, vllm_padded_vocab
from megarl.models.spec import ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout
from megarl.reshard.planner import PlanError, plan_reshard


def spec_of(family="llama", vocab=101, hidden=16, layers=2, heads=4, kv=2, head_dim=4, ffn=12, tied=False):
    return ModelSpec(family, vocab, hidden, layers, heads, kv, head_dim, ffn, tie_word_embeddings=tied)


@st.composite
def reshard_cases(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    ffn = draw(st.sampled_from([4, 6, 8, 12]))
    layers = draw(st.sampled_from([1, 2, 4]))
    spec = spec_of(draw(st.sampled_from(["llama", "qwen2"])), draw(st.integers(1, 300)),
                   draw(st.sampled_from([8, 12])), layers, heads, kv, draw(st.sampled_from([2, 4])), ffn,
                   draw(st.booleans()))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if kv % t == 0 and heads % t == 0 and ffn % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if layers % p == 0]))
    dp = draw(st.sampled_from([1, 2]))
    pool = draw(st.permutations(range(32)))
    src = megatron_layout(spec, ParallelLayout(tp, pp, dp), ranks=pool[:tp * pp * dp])
    if draw(st.booleans()):
        vtps = [t for t in (1, 2, 4, 8) if heads % t == 0 and ffn % t == 0
                and vllm_padded_vocab(spec.vocab_size) % t == 0 and (t % kv == 0 if t >= kv else kv % t == 0)]
        vtp = draw(st.sampled_from(vtps))
        dst = vllm_layout(spec, vtp, draw(st.permutations(range(32)))[:vtp * draw(st.sampled_from([1, 2]))])
    else:
        dst = hf_layout(spec, draw(st.permutations(range(32)))[:draw(st.integers(1, 3))])
    return src, dst, draw(st.sampled_from([None, 1, 2, 4]))


def _element_ids(layout: Layout, rank: int, local: str) -> np.ndarray:
    """For every element of a local tensor, which canonical element it holds (-1: padding), as
    ``canonical tensor number * 2**32 + flat index``."""
    lt = layout.tensors(rank)[local]
    names = sorted(layout.canonical)
    ids = np.full(lt.shape, -1, dtype=np.int64)
    for b in lt.blocks:
        flat = np.arange(np.prod(layout.canonical[b.name])).reshape(layout.canonical[b.name])
        box = flat[tuple(slice(s, s + n) for s, n in zip(b.src, b.size))]
        ids[tuple(slice(s, s + n) for s, n in zip(b.dst, b.size))] = names.index(b.name) * 2**32 + box
    return ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_every_destination_element_is_written_exactly_once(case):
    src, dst, rpn = case
    plan = plan_reshard(src, dst, rpn)
    writes = {(r, n): np.zeros(lt.shape, dtype=np.int64) for r in dst.ranks for n, lt in dst.tensors(r).items()}
    for t in plan.transfers:
        # both ends of the box hold the same canonical elements
        src_ids = _element_ids(src, t.src_rank, t.src_name)[tuple(slice(s, s + n) for s, n in zip(t.src_start, t.size))]
        dst_box = tuple(slice(s, s + n) for s, n in zip(t.dst_start, t.size))
        np.testing.assert_array_equal(src_ids, _element_ids(dst, t.dst_rank, t.dst_name)[dst_box], err_msg=str(t))
        assert src_ids.min() >= 0, t
        writes[(t.dst_rank, t.dst_name)][dst_box] += 1
    for (r, name), count in writes.items():
        np.testing.assert_array_equal(count, _element_ids(dst, r, name) >= 0, err_msg=f"{name} on rank {r}")
    # a replica on the destination rank itself is always used
    for t in plan.transfers:
        if t.src_rank != t.dst_rank and t.dst_rank in src.ranks:
            mine = np.concatenate([_element_ids(src, t.dst_rank, n).ravel() for n in src.tensors(t.dst_rank)])
            wanted = _element_ids(src, t.src_rank, t.src_name)[
                tuple(slice(s, s + n) for s, n in zip(t.src_start, t.size))]
            assert not np.isin(wanted, mine).any(), t


def test_the_destination_rank_then_the_same_node_then_balance():
    spec = spec_of(tied=True)
    src = megatron_layout(spec, ParallelLayout(1, 1, 4), ranks=[0, 2, 4, 6])
    plan = plan_reshard(src, hf_layout(spec, range(8)), 2)
    for t in plan.transfers:
        assert t.src_rank == t.dst_rank - t.dst_rank % 2, t  # itself, else its node peer
    # no replica near rank 8: its bytes spread evenly over the four replicas
    plan = plan_reshard(megatron_layout(spec, ParallelLayout(1, 1, 4)), hf_layout(spec, [8]), 4)
    load = defaultdict(int)
    for t in plan.transfers:
        load[t.src_rank] += t.numel
    assert sorted(load) == [0, 1, 2, 3]
    assert max(load.values()) - min(load.values()) <= max(t.numel for t in plan.transfers)


def test_ranks_per_node_comes_from_the_launcher(monkeypatch):
    from megarl.parallel import mesh

    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(mesh.torch.cuda, "is_available", lambda: False)
    assert mesh.ranks_per_node(16) is None  # a CPU job without a launcher: one node
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    assert mesh.ranks_per_node(16) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's wins
    assert mesh.ranks_per_node(16) == 4 and mesh.ranks_per_node(2) == 2


def test_tied_embeddings_come_from_the_last_stage_copy_where_that_is_the_destination():
    spec = spec_of(tied=True)
    src = megatron_layout(spec, ParallelLayout(1, 2, 1))
    plan = plan_reshard(src, vllm_layout(spec, 1, [1]))
    embed = [t for t in plan.transfers if t.canonical == "model.embed_tokens.weight"]
    assert [(t.src_rank, t.src_name) for t in embed] == [(1, "output_layer.weight")]


def test_plans_are_cached_per_layout_pair_and_deterministic():
    spec = spec_of()
    a = plan_reshard(megatron_layout(spec, ParallelLayout(2, 1, 2)), vllm_layout(spec, 4, range(4)))
    b = plan_reshard(megatron_layout(spec, ParallelLayout(2, 1, 2)), vllm_layout(spec, 4, range(4)))
    assert a is b
    plan_reshard.cache_clear()
    c = plan_reshard(megatron_layout(spec, ParallelLayout(2, 1, 2)), vllm_layout(spec, 4, range(4)))
    assert c is not a and c.transfers == a.transfers
    # the gate and up halves of linear_fc1 -> gate_up_proj at the same TP travel as one box
    same = plan_reshard(megatron_layout(spec, ParallelLayout(2, 1, 1)), vllm_layout(spec, 2, range(2)))
    fc1 = [t for t in same.transfers if t.dst_name.endswith("gate_up_proj.weight")]
    assert len(fc1) == 2 * spec.num_layers and all(t.size == (spec.ffn_hidden_size, 16) for t in fc1)


# ------------------------------------------------------------------------------------------ plan-time errors
def test_canonical_shape_mismatch_is_refused():
    with pytest.raises(PlanError, match=r"lm_head\.weight. has canonical shape \(101, 16\) in the source "
                                        r"\(megatron\) but \(102, 16\)"):
        plan_reshard(megatron_layout(spec_of(), ParallelLayout()), hf_layout(spec_of(vocab=102), [0]))
    with pytest.raises(PlanError, match=r"lm_head\.weight.*not held by the source"):
        plan_reshard(megatron_layout(spec_of(tied=True), ParallelLayout()), hf_layout(spec_of(), [0]))


def _custom(kind: str, name: str, shape, per_rank: dict[int, list[Block]]) -> Layout:
    ranks = {r: {"t": LocalTensor("t", shape, tuple(blocks))} for r, blocks in per_rank.items()}
    return Layout(kind, spec_of(), {name: shape}, ranks, (kind, name, repr(per_rank)))


def test_uncovered_destination_blocks_are_refused():
    spec = spec_of()
    full = megatron_layout(spec, ParallelLayout(2, 1, 1))
    half = Layout("megatron", spec, full.canonical, {0: full.tensors(0)}, ("half", 0))
    with pytest.raises(PlanError, match=r"model\.embed_tokens\.weight.* \(101, 16\).*not covered.*1024 of 1616"):
        plan_reshard(half, hf_layout(spec, [0]))


def test_overlapping_source_tilings_are_refused():
    src = _custom("src", "w", (10, 4), {0: [Block("w", (0, 0), (0, 0), (6, 4))],
                                        1: [Block("w", (4, 0), (0, 0), (6, 4))]})
    dst = _custom("dst", "w", (10, 4), {2: [Block("w", (0, 0), (0, 0), (10, 4))]})
    with pytest.raises(PlanError, match=r"\[0, 6\) x \[0, 4\).*\[4, 10\) x \[0, 4\).*'w' \(10, 4\) overlap"):
        plan_reshard(src, dst)
    # identical boxes are replicas, not an overlap
    src = _custom("src2", "w", (10, 4), {0: [Block("w", (0, 0), (0, 0), (10, 4))],
                                         1: [Block("w", (0, 0), (0, 0), (10, 4))]})
    assert {t.src_rank for t in plan_reshard(src, dst).transfers} == {0}


def test_out_of_bounds_blocks_are_refused():
    src = _custom("src3", "w", (10, 4), {0: [Block("w", (0, 0), (0, 0), (11, 4))]})
    with pytest.raises(PlanError, match="out of bounds"):
        plan_reshard(src, _custom("dst3", "w", (10, 4), {1: [Block("w", (0, 0), (0, 0), (10, 4))]}))


def test_a_vllm_tp_that_does_not_fit_fails_when_the_plan_is_made():
    spec = spec_of(heads=6, kv=2, ffn=12)
    src = megatron_layout(spec, ParallelLayout(2, 1, 1))
    with pytest.raises(SpecError, match=r"tp=4 does not divide the query heads of qkv_proj: num_attention_heads=6"):
        plan_reshard(src, vllm_layout(spec, 4, range(4)))
    with pytest.raises(SpecError, match=r"tp=3 .* num_kv_heads=2"):
        plan_reshard(src, vllm_layout(spec_of(heads=6, kv=2, ffn=12), 3, range(3)))
    with pytest.raises(SpecError, match=r"gate_up_proj: ffn_hidden_size=10"):
        plan_reshard(src, vllm_layout(spec_of(ffn=10), 4, range(4)))
