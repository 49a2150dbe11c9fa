"""Block-FP8 reshard: the quantise op (megarl._C on CPU, and its torch fallback) against an independent torch
implementation of vLLM's 128 x 128 block quantisation, and the FP8 plan run on gloo (Megatron TP=2 -> vLLM
TP=1 and TP=2 layouts): every E4M3 byte and scale equals quantising the HF tensors, then slicing them as vLLM
shards them.

The reference below is written from the format's definition (``vllm.utils.deep_gemm.per_block_cast_to_fp8`` of
vLLM 0.24.0 with ``use_ue8m0=False``: pad to whole tiles, amax per tile clamped at 1e-4, scale = amax times the
float32 1 / 448 (the GPU's form of its amax / 448.0, megarl.models.fp8),
values times 1 / scale to E4M3) with whole-tensor torch ops; it uses neither megarl.models.fp8 nor the layouts.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.reshard import boxcopy
from megarl.reshard.boxcopy import Box
from megarl.reshard.quantize import QuantBatch, TileJob
from tests.distributed import run_world
from tests.test_reshard_exact import _pad_rows

E4M3 = torch.float8_e4m3fn
needs_ext = pytest.mark.skipif(not boxcopy.extension_available(),
                               reason="megarl._C not built (python setup.py build_ext --inplace)")


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E4M3 [rows, cols], float32 [ceil(rows / 128), ceil(cols / 128)])`` of a 2-D tensor, whole-tensor ops."""
    rows, cols = w.shape
    tr, tc = -(-rows // 128), -(-cols // 128)
    x = torch.zeros(tr * 128, tc * 128)
    x[:rows, :cols] = w.float()
    tiles = x.view(tr, 128, tc, 128)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-4) * (1.0 / 448.0)
    q = (tiles * (1.0 / scale)[:, None, :, None]).to(E4M3).view(tr * 128, tc * 128)[:rows, :cols]
    return q.contiguous(), scale


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------------------------------------ the op
@st.composite
def tilings(draw):
    """A random weight, its tiles, each cut into up to 3 x 2 parts read from one of two copies of the weight
    (another dtype and a row offset), written into a 2-D E4M3 tensor or packed into a uint8 buffer."""
    rows, cols = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([1e-6, 1.0, 300.0]))
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * scale).to(dtype)
    if draw(st.booleans()):
        w[:min(rows, 128), :min(cols, 128)] = 0  # an all-zero tile: the 1e-4 floor
    shift = draw(st.integers(0, 5))
    copy = torch.zeros(rows + shift, cols + 3, dtype=torch.float32)
    copy[shift:, 1:cols + 1] = w.float()
    packed = draw(st.booleans())
    jobs, origins, offset = [], [], 0
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            tr, tc = min(128, rows - i), min(128, cols - j)
            rcut = sorted({0, tr, *draw(st.lists(st.integers(1, max(1, tr - 1)), max_size=2))})
            ccut = sorted({0, tc, draw(st.integers(0, tc))})
            parts = []
            for r0, r1 in zip(rcut, rcut[1:]):
                for c0, c1 in zip(ccut, ccut[1:]):
                    if r1 > r0 and c1 > c0:
                        if draw(st.booleans()):
                            src = Box("w", (i + r0, j + c0), (r1 - r0, c1 - c0))
                        else:
                            src = Box("copy", (shift + i + r0, 1 + j + c0), (r1 - r0, c1 - c0))
                        parts.append((src, (r0, c0)))
            if packed:
                dst, sc = Box("buf", (offset,), (tr, tc), True), Box("sbuf", (len(jobs),), (1,), True)
                offset += tr * tc
            else:
                dst, sc = Box("q", (i, j), (tr, tc)), Box("s", (i // 128, j // 128), (1, 1))
            jobs.append(TileJob(dst, sc, tuple(parts)))
            origins.append((i, j))
    return w, copy, jobs, origins, packed


def _run(case, use_extension):
    w, copy, jobs, origins, packed = case
    rows, cols = w.shape
    tensors = {"w": w, "copy": copy, "q": torch.zeros(rows, cols, dtype=E4M3),
               "s": torch.zeros(-(-rows // 128), -(-cols // 128)), "buf": torch.zeros(rows * cols, dtype=torch.uint8),
               "sbuf": torch.zeros(len(jobs))}
    QuantBatch(jobs).run(tensors, use_extension=use_extension)
    if not packed:
        return _bytes(tensors["q"]), tensors["s"]
    q, s = torch.zeros(rows, cols, dtype=torch.uint8), torch.zeros(-(-rows // 128), -(-cols // 128))
    offset = 0
    for k, (job, (i, j)) in enumerate(zip(jobs, origins)):  # the packed tiles, back in place
        tr, tc = job.dst.size
        q[i:i + tr, j:j + tc] = tensors["buf"][offset:offset + tr * tc].view(tr, tc)
        s[i // 128, j // 128] = tensors["sbuf"][k]
        offset += tr * tc
    return q, s


@needs_ext
@settings(max_examples=20, deadline=None)
@given(tilings())
def test_the_extension_quantises_as_the_independent_reference_on_cpu(case):
    want_q, want_s = ref_quantize(case[0])
    got_q, got_s = _run(case, True)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q, _bytes(want_q))


@settings(max_examples=15, deadline=None)
@given(tilings())
def test_the_torch_fallback_quantises_as_the_independent_reference(case):
    want_q, want_s = ref_quantize(case[0])
    got_q, got_s = _run(case, False)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q, _bytes(want_q))


def test_a_wrong_reference_is_detected():
    """The comparison above can fail: a scale of amax / 240 (E4M3 FNUZ's max) gives other bytes."""
    w = torch.randn(200, 130)
    got = {"w": w, "q": torch.zeros(200, 130, dtype=E4M3), "s": torch.zeros(2, 2)}
    QuantBatch([TileJob(Box("q", (i, j), (min(128, 200 - i), min(128, 130 - j))), Box("s", (i // 128, j // 128), (1, 1)),
                        ((Box("w", (i, j), (min(128, 200 - i), min(128, 130 - j))), (0, 0)),))
                for i in (0, 128) for j in (0, 128)]).run(got)
    amax = w.abs().amax()
    assert not torch.equal(_bytes(got["q"]), _bytes((w * (240.0 / amax)).to(E4M3)))
    assert torch.equal(_bytes(got["q"]), _bytes(ref_quantize(w)[0]))


@needs_ext
def test_the_extension_refuses_bad_tensors():
    w, q, s = torch.randn(4, 4), torch.zeros(4, 4, dtype=E4M3), torch.zeros(1, 1)
    job = TileJob(Box("q", (0, 0), (4, 4)), Box("s", (0, 0), (1, 1)), ((Box("w", (0, 0), (4, 4)), (0, 0)),))
    with pytest.raises(RuntimeError, match="float8_e4m3fn or uint8"):
        QuantBatch([job]).run({"w": w, "q": torch.zeros(4, 4), "s": s}, use_extension=True)
    with pytest.raises(RuntimeError, match="float32 expected"):
        QuantBatch([job]).run({"w": w, "q": q, "s": torch.zeros(1, 1, dtype=torch.float64)}, use_extension=True)
    with pytest.raises(RuntimeError, match="outside its tensor"):
        QuantBatch([job._replace(dst=Box("q", (1, 0), (4, 4)))]).run({"w": w, "q": q, "s": s}, use_extension=True)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        QuantBatch([job]).run({"w": w.double(), "q": q, "s": s}, use_extension=True)
    with pytest.raises(ValueError, match="does not fit its tile"):
        QuantBatch([job._replace(parts=((Box("w", (0, 0), (4, 4)), (1, 0)),))])


# ------------------------------------------------------------------------------------------ the reshard on gloo
MODELS = {
    # family, vocab, hidden, layers, heads, kv heads, head_dim, ffn, tied
    # 64-row KV heads and 192-row halves of the FFN at Megatron TP=2: tiles that no source rank holds whole
    "cut": ("qwen2", 300, 256, 2, 4, 2, 64, 384, True),
    # aligned splits, a hidden size of 2.5 tiles (cut tiles at the edges), untied
    "aligned": ("llama", 200, 320, 2, 4, 2, 128, 512, False),
}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _hf(model: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from tests.test_reshard_exact import hf_weights

    return {k: v.to(dtype) for k, v in hf_weights(MODELS[model], seed=1).items()}


def ref_vllm_fp8(model: str, w: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM's block-FP8 tensors of TP rank ``r``: each HF linear weight quantised whole (:func:`ref_quantize`),
    its E4M3 bytes and its scale grid then sliced as vLLM shards the weight (rows ``chunk(tp)``, KV heads
    replicated past ``tp = kv``, row-parallel columns ``chunk(tp, dim=1)``; a shard's 128-aligned slice of the
    bytes is the same slice / 128 of the scales); the other tensors as the model dtype."""
    fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
    q = {n: ref_quantize(t) for n, t in w.items() if n.endswith("proj.weight")}

    def rows(name: str, lo: int, hi: int):
        values, scales = q[name]
        return _bytes(values)[lo:hi], scales[lo // 128:-(-hi // 128)]

    def chunk(name: str, dim: int):
        values, scales = q[name]
        n = values.shape[dim] // tp
        return (_bytes(values).narrow(dim, r * n, n), scales.narrow(dim, r * n // 128, -(-n // 128)))

    out = {"model.embed_tokens.weight": _pad_rows(w["model.embed_tokens.weight"], -(-vocab // 64) * 64).chunk(tp)[r]}
    for i in range(layers):
        p = f"model.layers.{i}."
        parts = [chunk(p + "self_attn.q_proj.weight", 0)]
        for x in "kv":
            name = p + f"self_attn.{x}_proj.weight"
            head = r // (tp // kv) if tp > kv else None
            parts.append(rows(name, head * hd, (head + 1) * hd) if head is not None else chunk(name, 0))
        gate_up = [chunk(p + "mlp.gate_proj.weight", 0), chunk(p + "mlp.up_proj.weight", 0)]
        for name, pieces in (("self_attn.qkv_proj", parts), ("mlp.gate_up_proj", gate_up)):
            out[p + name + ".weight"] = torch.cat([v for v, _ in pieces])
            out[p + name + ".weight_scale_inv"] = torch.cat([s for _, s in pieces])
        for name, hf_name in (("self_attn.o_proj", "self_attn.o_proj.weight"), ("mlp.down_proj", "mlp.down_proj.weight")):
            out[p + name + ".weight"], out[p + name + ".weight_scale_inv"] = chunk(p + hf_name, 1)
        if fam == "qwen2":
            bias = [w[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]
            out[p + "self_attn.qkv_proj.bias"] = torch.cat([bias[0].chunk(tp)[r]] + [
                b[(r // (tp // kv)) * hd:(r // (tp // kv) + 1) * hd] if tp > kv else b.chunk(tp)[r] for b in bias[1:]])
        out[p + "input_layernorm.weight"] = w[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = w[p + "post_attention_layernorm.weight"]
    out["model.norm.weight"] = w["model.norm.weight"]
    if not tied:
        out["lm_head.weight"] = _pad_rows(w["lm_head.weight"], -(-vocab // 64) * 64).chunk(tp)[r]
    return {k: v.contiguous() for k, v in out.items()}


def _fp8_world(rank: int, world: int) -> dict:
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.spec import ModelSpec
    from megarl.parallel.mesh import ParallelLayout
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import GATHER, plan_reshard
    from tests.test_reshard_exact import ref_megatron

    results = {}
    n = 0
    for model, (fam, vocab, h, layers, heads, kv, hd, ffn, tied) in MODELS.items():
        spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
        for src_mesh, dst_tp, dtype in ((ParallelLayout(2, 1, 1), 1, torch.bfloat16), (ParallelLayout(2, 1, 1), 2, torch.float32),
                                        (ParallelLayout(1, 1, 2), 2, torch.bfloat16), (ParallelLayout(1, 1, 2), 1, torch.float32)):
            label = f"{model}: megatron tp{src_mesh.tp} dp{src_mesh.dp} {dtype} -> vllm tp{dst_tp} fp8"
            if model == "cut" and dst_tp == 2:
                continue  # 64-row KV shards: vLLM refuses block FP8 there (check_vllm_fp8)
            n += 1
            w = _hf(model, dtype)
            src = megatron_layout(spec, src_mesh)
            dst = vllm_layout(spec, dst_tp, range(2), quantization="fp8")
            src_tensors = ref_megatron(MODELS[model], w, src_mesh.tp, 1, rank % src_mesh.tp, 0)
            want = ref_vllm_fp8(model, w, dst_tp, rank % dst_tp)
            got = {}  # the quantised tensors start as NaN (unwritten bytes show), the others as the padding's 0
            for name, lt in dst.tensors(rank).items():
                quantised = lt.scale or name.endswith("_scale_inv")
                kind = E4M3 if lt.scale else torch.float32 if quantised else dtype
                got[name] = torch.full(lt.shape, float("nan") if quantised else 0.0).to(kind)
            if set(got) != set(want):
                results[label] = f"names differ: {sorted(set(got) ^ set(want))}"
                continue
            plan = plan_reshard(src, dst)
            stats = execute_plan(plan, src_tensors, got, bucket_bytes=(20_000, 1 << 20)[n % 2],
                                 use_extension=None if n % 3 else False)
            bad = [k for k in want if not torch.equal(_bytes(got[k]) if got[k].dtype == E4M3 else got[k], want[k])]
            fp8_tiles = sum(math.prod(-(-s // 128) for s in lt.shape) for lt in dst.tensors(rank).values() if lt.scale)
            results[label] = dict(bad=bad, gathered=sum(t.parts[0].src_name == GATHER for t in plan.tiles_for(rank).local),
                                  remote=len(plan.tiles_for(rank).recvs), tiles=fp8_tiles,
                                  received=stats.bytes_received, rounds=stats.rounds)
    return results


@pytest.fixture(scope="module")
def fp8_world() -> list[dict]:
    return run_world(_fp8_world, 2, timeout_s=300)


def test_every_fp8_byte_and_scale_equals_quantising_the_hf_tensors_then_slicing(fp8_world):
    labels = list(fp8_world[0])
    assert len(labels) == 6, labels
    for rank, res in enumerate(fp8_world):
        for label, r in res.items():
            assert not isinstance(r, str), (rank, label, r)
            assert not r["bad"], (rank, label, r["bad"])


def test_the_cases_cover_gathered_and_remote_tiles(fp8_world):
    """Megatron TP=2 of the "cut" model cuts tiles (gathered on the destination); two vLLM TP=1 engines on
    the two ranks of Megatron TP=2 receive half of each tile-aligned weight quantised by the other rank."""
    cut = fp8_world[0]["cut: megatron tp2 dp1 torch.bfloat16 -> vllm tp1 fp8"]
    assert cut["gathered"] > 0 and cut["remote"] > 0
    aligned = fp8_world[1]["aligned: megatron tp2 dp1 torch.bfloat16 -> vllm tp1 fp8"]
    assert aligned["gathered"] == 0 and aligned["remote"] > 0
    # the quantised half of the weights travels at a byte an element (plus the scales): under the bf16 bytes
    assert aligned["received"] < 2 * aligned["tiles"] * 128 * 128 / 2
    local = fp8_world[0]["aligned: megatron tp1 dp2 torch.bfloat16 -> vllm tp2 fp8"]
    assert local["remote"] == local["received"] == 0
