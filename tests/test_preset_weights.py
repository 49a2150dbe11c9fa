"""``preset:NAME`` models hold the same weights at every layout (issue 33, item 6).

A preset's weights are canonical (Hugging Face layout) tensors drawn from the run's seed and each tensor's name,
sliced for the rank like a Hugging Face checkpoint's (:func:`megarl.models.weights.preset_reader`), so a run
resumed at another TP / PP layout trains against the same reference model. One 2-rank gloo world builds the
trainer's worker (:class:`~megarl.workers.engine.MegatronWorker`, as the reference is built) of a 2-layer
``tiny-llama`` at TP=1, TP=2 and PP=2 and compares the logits on one input.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import SpecError, preset
from tests.distributed import run_world

SOURCE = "preset:tiny-llama?layers=2"
MESHES = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) in a world of 2: dp fills the rest


def _logits(model, tokens):
    """Full-vocab logits on the last pipeline stage (None elsewhere)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.models.pipeline import run_microbatches

    def output_fn(mb, out):
        return out.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(out).detach()}

    with torch.no_grad():
        res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=True)
    return res[0]["logits"] if res else None


def _world(rank, world):
    from megarl.config import ActorConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.engine import MegatronWorker

    spec = preset(SOURCE.removeprefix("preset:"))
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    for seed, meshes in ((7, MESHES), (8, MESHES[:1])):
        for tp, pp in meshes:
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp))
            initialize_model_parallel(mesh, seed=seed)
            worker = MegatronWorker(spec, mesh, "actor", SOURCE, torch.float32, ActorConfig(), trainable=False,
                                    seed=seed)
            logits = _logits(worker.model, tokens)
            if logits is not None:
                out[(seed, tp, pp)] = logits[..., :spec.vocab_size]
    return out


@pytest.fixture(scope="module")
def logits():
    merged = {}
    for r in run_world(_world, 2):
        merged.update(r)
    return merged


@pytest.mark.parametrize("tp,pp", MESHES[1:])
def test_preset_logits_equal_at_every_layout(logits, tp, pp):
    ref, got = logits[(7, 1, 1)], logits[(7, tp, pp)]
    assert ref.abs().max() > 0.01  # a real model, not zeros
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_preset_weights_follow_the_seed(logits):
    assert (logits[(7, 1, 1)] - logits[(8, 1, 1)]).abs().max() > 0.01


def test_preset_reader_boxes_are_slices_of_one_tensor():
    from megarl.models.weights import preset_reader

    spec = preset("tiny-llama?layers=2")
    read = preset_reader(spec, "actor", seed=5)
    name = "model.layers.1.self_attn.o_proj.weight"  # [64, 64], an output projection: scaled std
    whole = read(name, (slice(0, 64), slice(0, 64)))
    torch.testing.assert_close(read(name, (slice(8, 40), slice(32, 64))), whole[8:40, 32:64], rtol=0, atol=0)
    assert abs(whole.std().item() - 0.02 / (2 * spec.num_layers) ** 0.5) < 0.002 and abs(whole.mean()) < 0.002
    emb = read("model.embed_tokens.weight", (slice(0, 4096), slice(0, 64)))
    assert abs(emb.std().item() - 0.02) < 0.0005 and abs(emb.mean().item()) < 0.0005
    assert torch.equal(read("model.norm.weight", (slice(0, 64),)), torch.ones(64))
    other = preset_reader(spec, "actor", seed=6)(name, (slice(0, 64), slice(0, 64)))
    assert not torch.equal(other, whole)
    assert torch.equal(preset_reader(spec, "critic", seed=5)("score.weight", (slice(0, 1), slice(0, 64))),
                       torch.zeros(1, 64))
    with pytest.raises(SpecError, match="lm_head.weight"):
        read("lm_head.weight", (slice(0, 1), slice(0, 64)))  # tied embeddings: no such tensor
