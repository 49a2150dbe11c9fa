"""The reshard executor's schedule and single-rank runs, and the batched box copy (megarl._C and the pure-torch
path), in one process."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.models.layout import hf_layout
from megarl.models.layout_megatron import megatron_layout
from megarl.models.layout_vllm import vllm_layout
from megarl.models.spec import ModelSpec
from megarl.parallel.mesh import ParallelLayout
from megarl.reshard import boxcopy
from megarl.reshard.boxcopy import Box, BoxBatch
from megarl.reshard.executor import execute_plan
from megarl.reshard.planner import plan_reshard
from megarl.reshard.rounds import ROUND_MIN_BYTES, STAGING, _schedule, rank_rounds
from tests.test_reshard_exact import MODELS, hf_weights, ref_megatron, ref_vllm

needs_ext = pytest.mark.skipif(not boxcopy.extension_available(),
                               reason="megarl._C not built (python setup.py build_ext --inplace)")


def _spec(model: str) -> ModelSpec:
    fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
    return ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)


# ------------------------------------------------------------------------------------------ schedule
PLANS = {
    "tp2pp2dp2->vllm4": lambda s: (megatron_layout(s, ParallelLayout(2, 2, 2)), vllm_layout(s, 4, range(8))),
    "tp1dp2->hf on 3 ranks": lambda s: (megatron_layout(s, ParallelLayout(1, 2, 2)), hf_layout(s, [4, 5, 0])),
}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(PLANS)), st.sampled_from([64, 100, 256, 1000, 4096, 1 << 20]), st.sampled_from([2, 4]),
       st.sampled_from([None, 0, 64]))
def test_rounds_cover_every_remote_transfer_within_the_bucket(which, bucket, elem_size, direct_min):
    plan = plan_reshard(*PLANS[which](_spec("gqa_untied_bias")))
    rounds = _schedule(plan, elem_size, bucket, direct_min)
    cap = bucket // elem_size
    vcap = cap if direct_min is None else max(bucket, ROUND_MIN_BYTES) // elem_size
    written = {}
    for pieces in rounds:
        staged, moved = {}, {}
        for piece in pieces:
            p = piece.t
            assert p.numel <= max(1, (vcap if piece.src_direct and piece.dst_direct else cap) // 2)
            for r, direct in ((p.src_rank, piece.src_direct), (p.dst_rank, piece.dst_direct)):
                moved[r] = moved.get(r, 0) + p.numel
                staged[r] = staged.get(r, 0) + (0 if direct else p.numel)
            key = (p.dst_rank, p.dst_name)
            if key not in written:
                written[key] = np.zeros(plan.dst.tensors(p.dst_rank)[p.dst_name].shape, dtype=np.int64)
            written[key][tuple(slice(s, s + n) for s, n in zip(p.dst_start, p.size))] += 1
        assert max(staged.values()) <= cap and max(moved.values()) <= vcap
    if direct_min is None:
        assert not any(p.own_message for pieces in rounds for p in pieces)
    elif direct_min == 0 and bucket >= 256:
        assert any(p.src_direct and p.dst_direct for pieces in rounds for p in pieces)
    want = {}
    for t in plan.transfers:
        if t.src_rank != t.dst_rank:
            key = (t.dst_rank, t.dst_name)
            want.setdefault(key, np.zeros(plan.dst.tensors(t.dst_rank)[t.dst_name].shape, dtype=np.int64))
            want[key][tuple(slice(s, s + n) for s, n in zip(t.dst_start, t.size))] += 1
    assert written.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(written[key], want[key], err_msg=str(key))
    # every rank's view: staging = the staged elements of its round (messages through the staging buffer),
    # at most the bucket; a rank's messages to or from one peer are in the peer's order
    for rank in range(8):
        for rd in rank_rounds(plan, rank, elem_size, bucket, direct_min):
            assert rd.staging == sum(m.elements for m in rd.messages if m.key == STAGING) <= cap
            assert rd.staging == rd.pack.total_elements() + rd.unpack.total_elements()


# ------------------------------------------------------------------------------------------ single rank
@pytest.mark.parametrize("use_extension", [None, False])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", ["gqa_untied_bias", "mha_tied"])
def test_a_single_rank_reshard_is_a_local_copy_and_exact(model, dst_dtype, use_extension):
    spec, w = _spec(model), hf_weights(model)
    plan = plan_reshard(megatron_layout(spec, ParallelLayout()), vllm_layout(spec, 1, [0]))
    want = ref_vllm(model, w, 1, 0)
    got = {k: torch.nn.Parameter(torch.zeros(v.shape, dtype=dst_dtype)) for k, v in want.items()}
    stats = execute_plan(plan, ref_megatron(model, w, 1, 1, 0, 0), got, rank=0, use_extension=use_extension)
    assert stats.bytes_sent == stats.bytes_received == stats.peak_staging_bytes == stats.rounds == 0
    # every canonical element once, in the destination dtype
    elem = torch.empty((), dtype=dst_dtype).element_size()
    assert stats.bytes_copied_local == sum(v.numel() for v in w.values()) * elem
    for k in want:
        assert torch.equal(got[k].detach(), want[k].to(dst_dtype)), k


def test_bad_inputs_are_refused_with_the_tensor_named():
    spec, w = _spec("mha_tied"), hf_weights("mha_tied")
    plan = plan_reshard(megatron_layout(spec, ParallelLayout()), hf_layout(spec, [0]))
    src = ref_megatron("mha_tied", w, 1, 1, 0, 0)
    dst = {k: torch.zeros(v.shape) for k, v in w.items()}
    with pytest.raises(ValueError, match="bucket_bytes must be >= 64"):
        execute_plan(plan, src, dst, rank=0, bucket_bytes=32)
    with pytest.raises(ValueError, match=r"destination tensor 'model.norm.weight' of the plan is missing"):
        execute_plan(plan, src, {k: v for k, v in dst.items() if k != "model.norm.weight"}, rank=0)
    bad = dict(src, **{"decoder.final_layernorm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'decoder.final_layernorm.weight' has shape \(3,\), the layout says \(16,\)"):
        execute_plan(plan, bad, dst, rank=0)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    bad = dict(src, **{name: src[name].t().contiguous().t()})
    with pytest.raises(ValueError, match="last-dim stride"):
        execute_plan(plan, bad, dst, rank=0)


# ------------------------------------------------------------------------------------------ box copy
@st.composite
def box_cases(draw):
    """Random boxes from several source tensors into one destination (disjoint), half of them through a
    packed staging buffer as pack + unpack do, in dtypes of 1 to 8 bytes (every vector width)."""
    dtype = draw(st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.float64, torch.bfloat16]))
    dst = torch.zeros(draw(st.integers(1, 40)), draw(st.integers(1, 40)), dtype=torch.float64).to(dtype)
    tensors, stages, want = {"dst": dst}, ([], []), dst.clone()
    free = np.ones(dst.shape, dtype=bool)
    for i in range(draw(st.integers(1, 6))):
        src = (torch.randn(draw(st.integers(1, 30)), draw(st.integers(1, 30))) * 100).to(dtype)
        if draw(st.booleans()):
            src = src[:, draw(st.integers(0, src.shape[1] - 1)):]  # a view with a row stride wider than its rows
        rows = draw(st.integers(1, min(src.shape[0], dst.shape[0])))
        cols = draw(st.integers(1, min(src.shape[1], dst.shape[1])))
        s0, s1 = draw(st.integers(0, src.shape[0] - rows)), draw(st.integers(0, src.shape[1] - cols))
        d0, d1 = draw(st.integers(0, dst.shape[0] - rows)), draw(st.integers(0, dst.shape[1] - cols))
        if not free[d0:d0 + rows, d1:d1 + cols].all():
            continue
        free[d0:d0 + rows, d1:d1 + cols] = False
        tensors[f"src{i}"] = src
        want[d0:d0 + rows, d1:d1 + cols] = src[s0:s0 + rows, s1:s1 + cols]
        size = (rows, cols) if rows > 1 or draw(st.booleans()) else (cols,)
        if len(size) == 1:  # a 1-D box: one row of a 1-D view
            tensors[f"src{i}"], s0, s1 = src[s0, s1:s1 + cols], 0, 0
            tensors[f"row{i}"] = dst[d0, d1:d1 + cols]
            src_box, dst_box = Box(f"src{i}", (0,), size), Box(f"row{i}", (0,), size)
        else:
            src_box, dst_box = Box(f"src{i}", (s0, s1), size), Box("dst", (d0, d1), size)
        if draw(st.booleans()):
            tensors[f"buf{i}"] = torch.zeros(rows * cols + draw(st.integers(0, 9)), dtype=dtype)
            off = draw(st.integers(0, tensors[f"buf{i}"].numel() - rows * cols))
            stages[0].append((src_box, Box(f"buf{i}", (off,), size, True)))
            stages[1].append((Box(f"buf{i}", (off,), size, True), dst_box))
        else:
            stages[0].append((src_box, dst_box))
    return tensors, stages, want


def _run_boxes(case, use_extension, device="cpu"):
    tensors, stages, want = case
    if device != "cpu":  # the same views of the same storages, on the device
        storages = {}
        for k, t in tensors.items():
            base = t.untyped_storage()
            if base.data_ptr() not in storages:
                storages[base.data_ptr()] = torch.empty(0, dtype=t.dtype).set_(base).to(device)
        tensors = {k: storages[t.untyped_storage().data_ptr()].as_strided(t.shape, t.stride(), t.storage_offset())
                   for k, t in tensors.items()}
    for pairs in stages:  # pack-like copies first, then unpack-like ones: one batch each
        BoxBatch(pairs).run(tensors, use_extension)
    assert torch.equal(tensors["dst"].cpu(), want)


@settings(max_examples=40, deadline=None)
@given(box_cases())
def test_the_torch_path_copies_boxes(case):
    _run_boxes(case, use_extension=False)


@needs_ext
@settings(max_examples=40, deadline=None)
@given(box_cases())
def test_the_extension_copies_boxes_on_cpu(case):
    _run_boxes(case, use_extension=True)


@pytest.mark.gpu
@needs_ext
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=40, deadline=None)
@given(box_cases())
def test_the_extension_copies_boxes_on_cuda(case):
    _run_boxes(case, use_extension=True, device="cuda")


@needs_ext
def test_large_boxes_span_several_chunks_and_a_wrong_copy_is_detected():
    src = torch.arange(3000 * 700, dtype=torch.int32).view(3000, 700)  # 8.4 MB: many 1 MiB chunks
    dst = torch.zeros(3000, 701, dtype=torch.int32)
    BoxBatch([(Box("s", (0, 0), (3000, 700)), Box("d", (0, 1), (3000, 700)))]).run({"s": src, "d": dst}, True)
    assert torch.equal(dst[:, 1:], src) and not dst[:, 0].any()
    assert not torch.equal(dst[:, :700], src)


def test_a_cast_goes_through_torch_and_shapes_must_match():
    src, dst = torch.randn(5, 7), torch.zeros(5, 7, dtype=torch.bfloat16)
    BoxBatch([(Box("s", (1, 2), (3, 4)), Box("d", (0, 0), (3, 4)))]).run({"s": src, "d": dst})
    assert torch.equal(dst[:3, :4], src[1:4, 2:6].bfloat16()) and not dst[3:].any()
    with pytest.raises(ValueError, match=r"box copy of \(3, 4\) elements into \(4, 3\)"):
        BoxBatch([(Box("s", (0, 0), (3, 4)), Box("d", (0, 0), (4, 3)))])


def test_the_missing_extension_is_reported_once(monkeypatch, caplog):
    monkeypatch.setattr(boxcopy, "_C", None)
    monkeypatch.setattr(boxcopy, "_warned_missing", False)
    a, b = torch.ones(4), torch.zeros(4)
    batch = BoxBatch([(Box("a", (0,), (4,)), Box("b", (0,), (4,)))])
    with caplog.at_level(logging.WARNING, logger="megarl.reshard.boxcopy"):
        for _ in range(3):
            batch.run({"a": a, "b": b})
    assert torch.equal(a, b)
    assert sum("pure-torch fallback" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="not built"):
        batch.run({"a": a, "b": b}, use_extension=True)


def test_the_missing_extension_on_a_gpu_is_a_warning_with_its_cost():
    with pytest.warns(boxcopy.FallbackWarning, match=r"one torch copy_ per box \(410 kernel launches.*~8x longer"):
        boxcopy.warn_fallback(torch.device("cuda", 0), 410)


@needs_ext
def test_the_extension_refuses_boxes_outside_their_tensors():
    a, b = torch.zeros(4, 5), torch.zeros(10)
    with pytest.raises(RuntimeError, match=r"box 0 \[2, 5\) x \[1, 3\) lies outside its tensor of 4 x 5"):
        BoxBatch([(Box("a", (2, 1), (3, 2)), Box("b", (0,), (3, 2), True))]).run({"a": a, "b": b}, True)
    with pytest.raises(RuntimeError, match=r"packed box 0 of 2 x 3 at 5 lies outside its buffer of 10"):
        BoxBatch([(Box("a", (0, 0), (2, 3)), Box("b", (5,), (2, 3), True))]).run({"a": a, "b": b}, True)
