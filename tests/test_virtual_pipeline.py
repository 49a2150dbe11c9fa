"""Virtual pipeline stages (VPP, megatron's interleaved 1F1B schedule): the layer map, its errors, and one 2-rank
gloo world at PP=2 x VPP=2 (4 virtual stages of a 4-layer model).

In the world: log-probs (forward) and parameter gradients (backward) of the interleaved schedule against the
single-rank model on the same weights and micro-batches; the layout's names and shapes against the real model
chunks and the independent reference slicer of ``test_reshard_exact`` (a chunk is a virtual stage of a
PP x VPP-stage split); the reshard from the PP=2 x VPP=2 layout to vLLM and HF exact; ``megarl convert --vpp``
and dist checkpoints saved at PP=2 x VPP=2 loading at PP=1 and the reverse, and the export of the VPP
checkpoint bit-identical to the HF weights it came from.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from megarl.parallel.mesh import LayoutError, ParallelLayout
from tests.distributed import run_world
from tests.test_models_megatron import LLAMA, QWEN2, hf_model

TOL = 1e-5
# 4-layer variants of test_reshard_exact's models: PP=2 x VPP=2 needs 4 layers (registered in the world only)
RESHARD_MODELS = {"gqa_tied_4": ("llama", 157, 24, 4, 4, 2, 6, 20, True),
                  "gqa_untied_bias_4": ("qwen2", 157, 24, 4, 8, 2, 4, 20, False)}


# ----------------------------------------------------------------------------------------- layer map
@pytest.mark.parametrize("layers,pp,vpp", [(8, 2, 2), (8, 2, 4), (12, 3, 2), (8, 4, 1), (4, 2, 2)])
def test_chunk_layers_are_megatrons_layer_offsets(layers, pp, vpp):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
                               pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    mesh = ParallelLayout(pp=pp, vpp=vpp)
    seen = []
    for p in range(pp):
        chunks = mesh.chunk_layers(layers, p)
        assert len(chunks) == vpp
        for c, r in enumerate(chunks):
            assert len(r) == layers // (pp * vpp)
            assert r.start == get_transformer_layer_offset(config, vp_stage=c if vpp > 1 else None, pp_rank=p)
            seen += list(r)
    assert sorted(seen) == list(range(layers))


def test_chunk_layers_pp2_vpp2_of_8_layers():
    mesh = ParallelLayout(pp=2, vpp=2)
    assert mesh.chunk_layers(8, 0) == [range(0, 2), range(4, 6)]
    assert mesh.chunk_layers(8, 1) == [range(2, 4), range(6, 8)]


def test_layout_errors_name_the_field_and_the_fix():
    with pytest.raises(LayoutError, match=r"vpp=2 .*needs pp > 1"):
        ParallelLayout(pp=1, vpp=2)
    with pytest.raises(LayoutError, match=r"vpp must be >= 1"):
        ParallelLayout(pp=2, vpp=0)
    with pytest.raises(LayoutError, match=r"pp=2 x vpp=2 = 4 virtual pipeline stages do not divide num_layers=6; "
                                          r"vpp sizes that fit pp=2: \[1, 3\]"):
        ParallelLayout(pp=2, vpp=2).chunk_layers(6, 0)
    spec = ModelSpec("llama", 100, 16, 6, 2, 2, 8, 32)
    with pytest.raises(SpecError, match=r"pp=2 x vpp=2 .*num_layers=6; vpp sizes that fit pp=2: \[1, 3\]"):
        from megarl.models.megatron import check_layout

        check_layout(spec, ParallelLayout(pp=2, vpp=2))


def test_interleaved_schedule_micro_batch_counts():
    mesh = ParallelLayout(pp=2, vpp=2)
    for n in (2, 4, 6):
        mesh.check_num_microbatches(n)
    for n in (1, 3, 5):
        with pytest.raises(LayoutError, match=rf"{n} micro-batches: .*multiple of pp=2"):
            mesh.check_num_microbatches(n)
    for n in (1, 3):
        ParallelLayout(pp=2).check_num_microbatches(n)  # 1F1B without VPP takes any count


def test_config_vpp_errors_name_the_field():
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"actor\.parallel\.vpp: 2 interleaves pipeline stages and needs pp > 1"):
        load_config(None, ["actor.parallel.vpp=2"])
    with pytest.raises(ConfigError, match=r"critic\.parallel\.vpp: must be >= 1"):
        load_config(None, ["critic.parallel.vpp=0"])
    assert load_config(None, []).actor.parallel.vpp == 1


# ----------------------------------------------------------------------------------------- one world
def _micro_batches(spec: ModelSpec, n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [{"input_ids": torch.randint(0, spec.vocab_size, (2, 16), generator=g)} for _ in range(n)]


def _logprob_loss(spec: ModelSpec):
    """``output_fn``: minus the sum of the next-token log-probs, and the log-probs ``[b, s]``."""
    from megarl.models.logprobs import vocab_parallel_logprobs

    def output_fn(mb, out):
        logp, _ = vocab_parallel_logprobs(out, torch.roll(mb["input_ids"], -1, dims=1), vocab_size=spec.vocab_size)
        return -logp.sum(), {"logp": logp.detach()}

    return output_fn


def _parity(rank: int, out: dict) -> None:
    """PP=2 x VPP=2 against the single-rank model: log-probs, and gradients mapped through the layouts."""
    from megatron.core import parallel_state as ps

    from megarl.models.checkpoint import chunk_parameters
    from megarl.models.layout import canonical_shapes
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model, build_model_chunks
    from megarl.models.pipeline import run_microbatches
    from megarl.models.weights import assemble_canonical, fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import initialize_model_parallel

    spec = QWEN2
    read = state_dict_reader(hf_model(spec, 5).state_dict(), spec.hf_tensor_shapes())
    micro, loss = _micro_batches(spec), _logprob_loss(spec)

    single = ParallelLayout(dp=2)
    initialize_model_parallel(single)
    model = build_model(spec, single)
    local = megatron_rank_tensors(spec, single, 0, 0)
    fill_local_tensors(local, dict(model.named_parameters()), read)
    ref = run_microbatches(model, micro, loss, forward_only=False)
    ref_logp = torch.cat([r["logp"] for r in ref])
    ref_grad = assemble_canonical(local, {n: p.grad for n, p in model.named_parameters()}, canonical_shapes(spec))

    mesh = ParallelLayout(pp=2, vpp=2)
    initialize_model_parallel(mesh)
    chunks = build_model_chunks(spec, mesh)
    params = chunk_parameters(chunks)
    local = megatron_rank_tensors(spec, mesh, 0, ps.get_pipeline_model_parallel_rank())
    out["names"] = ({n: tuple(p.shape) for n, p in params.items()}, {n: lt.shape for n, lt in local.items()})
    out["pre_post"] = [(c.pre_process, c.post_process) for c in chunks]
    fill_local_tensors(local, params, read)
    with torch.no_grad():
        fwd = run_microbatches(chunks, micro, loss, forward_only=True)
    trained = run_microbatches(chunks, micro, loss, forward_only=False)
    if fwd:
        out["forward_diff"] = (torch.cat([r["logp"] for r in fwd]) - ref_logp).abs().max().item()
        out["train_forward_diff"] = (torch.cat([r["logp"] for r in trained]) - ref_logp).abs().max().item()
    diffs, missing = {}, []
    for name, lt in local.items():
        grad = params[name].grad
        if grad is None:
            missing.append(name)
            continue
        for b in lt.blocks:
            diffs[f"{name} <- {b.name}"] = (grad[b.dst_box] - ref_grad[b.name][b.src_box]).abs().max().item()
    out["grad_diffs"], out["grad_missing"] = diffs, missing
    out["grad_scale"] = max(g.abs().max().item() for g in ref_grad.values())
    try:
        run_microbatches(chunks, micro[:3], loss, forward_only=True)
    except LayoutError as e:
        out["three_micro_batches"] = str(e)


def _reshard(rank: int, world: int, out: dict) -> None:
    """The reshard from the PP=2 x VPP=2 layout, whose chunks hold the reference slicer's virtual stages."""
    from megarl.models.checkpoint import chunk_parameters
    from megarl.models.layout import hf_layout
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.megatron import build_model_chunks
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from tests.test_reshard_exact import MODELS, hf_weights, ref_megatron, ref_vllm

    MODELS.update(RESHARD_MODELS)  # this process only
    mesh = ParallelLayout(pp=2, vpp=2)
    initialize_model_parallel(mesh)
    for name, (fam, vocab, h, layers, heads, kv, hd, ffn, tied) in RESHARD_MODELS.items():
        spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
        w = hf_weights(name, seed=2)
        # chunk c of pipeline rank p is virtual stage c * pp + p of a pp * vpp-stage pipeline
        want = {f"{c}.{k}": v for c in range(2) for k, v in ref_megatron(name, w, 1, 4, 0, c * 2 + rank).items()}
        layout = megatron_layout(spec, mesh, ranks=range(world))
        params = chunk_parameters(build_model_chunks(spec, mesh))
        fill_local_tensors(layout.tensors(rank), params, state_dict_reader(w, spec.hf_tensor_shapes()))
        out[f"{name} names"] = (sorted(params), sorted(want))
        out[f"{name} loaded"] = [n for n in want if n not in params or not torch.equal(params[n].detach(), want[n])]
        src = {n: p.detach() for n, p in params.items()}
        for tp in (1, 2):
            ref = ref_vllm(name, w, tp, rank % tp)
            got = {n: torch.zeros(t.shape) for n, t in ref.items()}
            execute_plan(plan_reshard(layout, vllm_layout(spec, tp, range(world))), src, got, bucket_bytes=2048)
            out[f"{name} to vllm{tp}"] = [n for n in ref if not torch.equal(got[n], ref[n])]
        back = {n: torch.zeros(t.shape) for n, t in w.items()}
        execute_plan(plan_reshard(layout, hf_layout(spec, range(world))), src, back)
        out[f"{name} to hf"] = [n for n in w if not torch.equal(back[n], w[n])]


def _checkpoints(rank: int, world: int, tmp: str, out: dict) -> None:
    """``convert --vpp 2``, then PP=2 x VPP=2 -> PP=1 and PP=1 -> PP=2 x VPP=2 dist-checkpoint loads."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models import checkpoint as ck
    from megarl.models.checkpoint import chunk_parameters
    from megarl.models.convert import convert_rank
    from megarl.models.hf_io import save_hf_checkpoint
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model, build_model_chunks
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import initialize_model_parallel

    spec = LLAMA
    sd = {n: t for n, t in hf_model(spec, 6).state_dict().items() if n in spec.hf_tensor_shapes()}
    read = state_dict_reader(sd, spec.hf_tensor_shapes())
    if rank == 0:
        save_hf_checkpoint(f"{tmp}/hf_in", spec, sd)
    dist.barrier()
    convert_rank(rank, world, f"{tmp}/hf_in", f"{tmp}/vpp", 1, 2, None, 2)

    def expected(mesh, pp_rank):
        params = chunk_parameters(build_model_chunks(spec, mesh, init_weights=False))
        fill_local_tensors(megatron_rank_tensors(spec, mesh, 0, pp_rank), params, read)
        return params

    def equal(a, b):
        return sorted(a) == sorted(b) and all(torch.equal(a[n].detach(), b[n].detach()) for n in a)

    single = ParallelLayout(dp=2)
    initialize_model_parallel(single)
    model = build_model(spec, single)
    out["pp1_fresh_differs"] = not equal(dict(model.named_parameters()), expected(single, 0))
    ck.load_model(f"{tmp}/vpp", model)
    out["vpp_to_pp1"] = equal(dict(model.named_parameters()), expected(single, 0))
    ck.save_model(f"{tmp}/pp1", model)

    mesh = ParallelLayout(pp=2, vpp=2)
    initialize_model_parallel(mesh)
    chunks = build_model_chunks(spec, mesh)
    ck.load_model(f"{tmp}/pp1", chunks)
    out["pp1_to_vpp"] = equal(chunk_parameters(chunks), expected(mesh, ps.get_pipeline_model_parallel_rank()))
    ps.destroy_model_parallel()


def _world(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    _parity(rank, out)
    _reshard(rank, world, out)
    _checkpoints(rank, world, tmp, out)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vpp"))
    return tmp, run_world(_world, 2, tmp, timeout_s=600)


def test_chunks_match_the_layout_and_hold_embedding_and_head_on_the_end_stages(world):
    _, results = world
    for res in results:
        model_names, layout_names = res["names"]
        assert model_names == layout_names
    assert results[0]["pre_post"] == [(True, False), (False, False)]
    assert results[1]["pre_post"] == [(False, False), (False, True)]
    assert "1.output_layer.weight" in results[1]["names"][1] and "0.embedding.word_embeddings.weight" in \
        results[0]["names"][1]


def test_interleaved_logprobs_equal_the_single_rank_model(world):
    _, results = world
    last = results[1]
    assert last["forward_diff"] <= TOL and last["train_forward_diff"] <= TOL, last
    assert "forward_diff" not in results[0]  # only the last stage computes the loss


def test_interleaved_gradients_equal_the_single_rank_model(world):
    _, results = world
    for rank, res in enumerate(results):
        assert res["grad_missing"] == [], rank
        assert res["grad_diffs"] and max(res["grad_diffs"].values()) <= TOL, (rank, res["grad_diffs"])
        assert res["grad_scale"] > 1e-2  # the gradients compared are not all ~0


def test_interleaved_schedule_refuses_a_micro_batch_count_it_cannot_run(world):
    _, results = world
    for res in results:
        assert "3 micro-batches" in res["three_micro_batches"] and "multiple of pp=2" in res["three_micro_batches"]


@pytest.mark.parametrize("model", list(RESHARD_MODELS))
def test_reshard_from_pp2_vpp2_is_exact(world, model):
    _, results = world
    for rank, res in enumerate(results):
        names, want = res[f"{model} names"]
        assert names == want, rank
        assert res[f"{model} loaded"] == [], rank
        for dst in ("vllm1", "vllm2", "hf"):
            assert res[f"{model} to {dst}"] == [], (rank, dst)


def test_dist_checkpoints_reshard_between_pp2_vpp2_and_pp1(world):
    _, results = world
    for res in results:
        assert res["pp1_fresh_differs"]  # the load did the work
        assert res["vpp_to_pp1"] and res["pp1_to_vpp"]


def test_vpp_checkpoint_exports_bit_identical_hf_weights(world):
    from megarl.launch.convert import export_to_hf
    from megarl.models.hf_io import open_hf_checkpoint

    tmp, _ = world
    export_to_hf(f"{tmp}/vpp", f"{tmp}/hf_out")
    source, back = open_hf_checkpoint(f"{tmp}/hf_in"), open_hf_checkpoint(f"{tmp}/hf_out")
    assert sorted(back.tensor_names) == sorted(LLAMA.hf_tensor_shapes())
    assert [n for n in LLAMA.hf_tensor_shapes() if not torch.equal(back.read(n), source.read(n))] == []


def test_convert_checks_vpp_before_any_rank_starts(world):
    from megarl.models.convert import check_conversion

    tmp, _ = world
    check_conversion(f"{tmp}/hf_in", 1, 2, None, vpp=2)
    with pytest.raises(SpecError, match=r"--vpp 3: pp=2 x vpp=3 .*num_layers=4; vpp sizes that fit pp=2: \[1, 2\]"):
        check_conversion(f"{tmp}/hf_in", 1, 2, None, vpp=3)
    with pytest.raises(LayoutError, match=r"--vpp 2 --pp 1: .*needs pp > 1"):
        check_conversion(f"{tmp}/hf_in", 1, 1, None, vpp=2)
