"""The training-phase fast paths of ``kernels/`` against the plain paths they replace, fp32 on CPU.

One 2-rank gloo world runs every check at TP=1 (DP=2) and TP=2:
- ``chunked_logprobs`` (torch ops, and the Triton kernels under ``TRITON_INTERPRET=1``) against
  ``F.linear`` + ``vocab_parallel_logprobs``: log-probs, entropy and the gradients of hidden states and weight,
  with a temperature, a padded vocab (the TP=2 rank 1 holds padding rows) and chunks that do not divide the tokens;
- ``SDPAttention`` against megatron's ``DotProductAttention`` with GQA, and with a sliding window: output and
  gradients of query, key and value;
- whole ``GPTModel``s (tied and untied embeddings; TP=1, TP=2 and PP=2) with both switches on against the
  plain model with the same weights: log-probs, entropy and every parameter's gradient; the chunked path
  saves no tensor with a vocab dimension for its backward;
- ``chunked_logprobs`` on chosen positions only (``positions``) against the plain path with the loss on them;
- the actor worker with ``actor.kernels`` on (the default) and off, TP=2 with sequence parallelism: the same
  log-probs, entropy, PPO losses and gradient norm, the output layer run on the response tokens only.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

LLAMA = ModelSpec("llama", vocab_size=1000, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=256)
QWEN2 = ModelSpec("qwen2", vocab_size=1001, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=128, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, max_position_embeddings=256)
MESHES = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) in a world of 2


def _reldiff(a, b) -> float:
    """Largest difference relative to the largest magnitude of the reference ``a``: fp32 rounds a value near
    7 (a log-prob or entropy over a 1000-word vocab) to steps of 5e-7."""
    return float((a - b).abs().max() / a.abs().max())


def _output_layer_inputs(seed: int, b: int):
    """Random hidden states ``[s=13, b, 16]``, this TP rank's shard of a ``[1024, 16]`` output layer (rows past
    the vocabulary of 1000 zero) and labels ``[b, 13]``, from one generator (which goes on to draw more)."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(seed)
    s, h, vocab, padded = 13, 16, 1000, 1024
    hidden = torch.randn(s, b, h, generator=g)
    weight = torch.randn(padded, h, generator=g) * 0.5
    weight[vocab:] = 0
    labels = torch.randint(0, vocab, (b, s), generator=g)
    v_local = padded // ps.get_tensor_model_parallel_world_size()
    shard = weight[ps.get_tensor_model_parallel_rank() * v_local:][:v_local]
    return g, hidden, shard, labels, vocab


def _logprob_checks(tp: int) -> dict:
    """Chunked vs plain log-probs/entropy on random hidden states and an output-layer shard."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from megarl.kernels.chunked_logprobs import chunked_logprobs
    from megarl.models.logprobs import vocab_parallel_logprobs

    g, hidden, shard, labels, vocab = _output_layer_inputs(0, 2)
    a, c = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    out = {}
    for backend in ("plain", "torch", "triton"):
        x = hidden.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        if backend == "plain":
            logits = torch.nn.functional.linear(copy_to_tensor_model_parallel_region(x), w).transpose(0, 1)
            lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, temperature=0.7, with_entropy=True)
        else:
            lp, ent = chunked_logprobs(x, w, labels, vocab_size=vocab, temperature=0.7, with_entropy=True,
                                       chunk_tokens=7, backend=backend)
        (a * lp + c * ent).sum().backward()
        out[backend] = (lp.detach(), ent.detach(), x.grad, w.grad)
    diffs = {backend: [_reldiff(p, q) for p, q in zip(out["plain"], out[backend])] for backend in ("torch", "triton")}
    return diffs, out["plain"]


def _positions_checks(tp: int) -> list[float]:
    """Chunked log-probs on chosen positions only (``positions``) against the plain path with the loss on the
    same positions: log-probs and entropy there, the hidden and weight gradients; the other positions' largest
    |log-prob| and |entropy| (0)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from megarl.kernels.chunked_logprobs import chunked_logprobs
    from megarl.models.logprobs import vocab_parallel_logprobs
    from megarl.data.batch import response_positions

    g, hidden, shard, labels, vocab = _output_layer_inputs(1, 3)
    keep = response_positions(torch.tensor([4, 9, 12]), 5, labels.shape[1])  # the last row's runs past the end
    a, c = torch.randn(labels.shape, generator=g) * keep, torch.randn(labels.shape, generator=g) * keep
    out = {}
    for positions in (None, keep):
        x = hidden.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        if positions is None:
            logits = torch.nn.functional.linear(copy_to_tensor_model_parallel_region(x), w).transpose(0, 1)
            lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, temperature=0.7, with_entropy=True)
        else:
            lp, ent = chunked_logprobs(x, w, labels, vocab_size=vocab, temperature=0.7, with_entropy=True,
                                       chunk_tokens=4, backend="torch", positions=positions)
        (a * lp + c * ent).sum().backward()
        out[positions is None] = (lp.detach() * keep, ent.detach() * keep, x.grad, w.grad, lp.detach(), ent.detach())
    plain, fast = out[True], out[False]
    return ([_reldiff(p, q) for p, q in zip(plain[:4], fast[:4])]
            + [float(fast[4][~keep].abs().max()), float(fast[5][~keep].abs().max())])


def _attention_checks(tp: int) -> dict:
    """SDPAttention vs DotProductAttention, causal with GQA, and with a sliding window."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.kernels.attention import SDPAttention

    out = {}
    for window in (None, (3, 0)):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   kv_channels=16, tensor_model_parallel_size=tp, use_cpu_initialization=True, attention_dropout=0.0,
                                   attention_softmax_in_fp32=True, masked_softmax_fusion=False,
                                   window_size=window)
        g = torch.Generator().manual_seed(1)
        s, b, heads, groups, d = 11, 2, 4 // tp, 2 // tp, 16
        q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups))
        grad_out = torch.randn(s, b, heads * d, generator=g)
        res = []
        for cls in (DotProductAttention, SDPAttention):
            module = cls(config, 1, AttnMaskType.causal, "self")
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            y = module(*inputs, None)
            y.backward(grad_out)
            res.append([y.detach()] + [t.grad for t in inputs])
        out[window] = [_reldiff(p, q) for p, q in zip(*res)]
    return out


def _model_checks(spec: ModelSpec, tp: int, pp: int) -> dict:
    """A GPTModel with SDPA attention and chunked log-probs vs the plain one, forward and backward."""
    from megatron.core import parallel_state as ps

    from megarl.kernels.chunked_logprobs import LogprobOutput
    from megarl.models.logprobs import vocab_parallel_logprobs
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches

    torch.manual_seed(3)
    plain = build_model(spec, _mesh(tp, pp), attention="local")
    fast = build_model(spec, _mesh(tp, pp), attention="sdpa")
    fast.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, spec.vocab_size, (2, 19), generator=g)
    a, c = torch.randn(2, 19, generator=g), torch.randn(2, 19, generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    saved: list[tuple[int, ...]] = []

    def record(t):
        saved.append(tuple(t.shape))
        return t

    def run(model, kwargs):
        def output_fn(mb, out):
            if kwargs:
                lp, ent = out
            else:
                lp, ent = vocab_parallel_logprobs(out, labels, vocab_size=spec.vocab_size, temperature=0.8,
                                                  with_entropy=True)
            return (a * lp + c * ent).sum(), {"lp": lp.detach(), "ent": ent.detach()}

        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=False,
                                   model_kwargs=kwargs)
        return res, {n: p.grad for n, p in model.named_parameters()}

    res_plain, grads_plain = run(plain, None)
    n_plain = list(saved)
    saved.clear()
    res_fast, grads_fast = run(fast, {"output_processor": LogprobOutput(
        vocab_size=spec.vocab_size, temperature=0.8, with_entropy=True, chunk_tokens=10)})
    have = sorted(n for n, gr in grads_plain.items() if gr is not None)
    out = {"grad_names": have == sorted(grads_plain) == sorted(n for n, gr in grads_fast.items() if gr is not None)}
    out["grads"] = max(_reldiff(grads_plain[n], grads_fast[n]) for n in have)
    if res_plain:
        out["lp"] = _reldiff(res_plain[0]["lp"], res_fast[0]["lp"])
        out["ent"] = _reldiff(res_plain[0]["ent"], res_fast[0]["ent"])
        v_local = plain.vocab_size // tp

        def logits_sized(shape):  # [b, s, v_local] or [s, b, v_local], any dtype
            return v_local in shape and torch.Size(shape).numel() == tokens.numel() * v_local

        out["vocab_saved_plain"] = any(map(logits_sized, n_plain))
        out["vocab_saved_fast"] = any(map(logits_sized, saved))
    ps.destroy_model_parallel()
    return out


def _worker_checks() -> dict:
    """PolicyWorker with the kernels on vs off (TP=2, sequence parallel): log-probs and one PPO update."""
    from megatron.core import parallel_state as ps

    from megarl.kernels.chunked_logprobs import _ChunkedLogprobs
    from megarl.config import ActorConfig, AlgorithmConfig, KernelsConfig, KLConfig, ParallelConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker
    from tests.test_dynamic_batch import SPEC, _batch

    mesh = ParallelLayout(tp=2)
    initialize_model_parallel(mesh, seed=0)
    rc = {"parallel": ParallelConfig(tp=2, sequence_parallel=True), "micro_batch_size": 4, "ppo_mini_batch_size": 8}
    fast = PolicyWorker(SPEC, mesh, "actor", "preset:random", torch.float32,
                        ActorConfig(**rc, kernels=KernelsConfig(logprob_chunk_tokens=50)), trainable=True,
                        temperature=0.9)
    plain = PolicyWorker(SPEC, mesh, "actor", fast, torch.float32,
                         ActorConfig(**rc, kernels=KernelsConfig(chunked_logprob=False, attention="local")),
                         trainable=True, temperature=0.9)
    batch = _batch()
    mask = batch["response_mask"].bool()
    seen = []  # tokens whose logits the fast worker's output layer computes, per call

    def counting(hidden, *args):
        seen.append(hidden.shape[0] * hidden.shape[1])
        return apply(hidden, *args)

    apply = _ChunkedLogprobs.apply
    _ChunkedLogprobs.apply = counting
    try:
        lps = [w.compute_logprobs(batch, with_entropy=True) for w in (plain, fast)]
    finally:
        _ChunkedLogprobs.apply = apply
    # only the response tokens' labels: one per response column of each row (within the sequence), not b x s
    width, s = batch["response_mask"].shape[1], batch["input_ids"].shape[1]
    out_tokens = {"seen": sum(seen), "response": int((batch["prompt_lens"].unsqueeze(1) - 1
                                                       + torch.arange(width) < s).sum()),
                  "all": len(batch) * s}
    out = {k: _reldiff(torch.where(mask, lps[0][k], 0.0), torch.where(mask, lps[1][k], 0.0))
           for k in ("logprobs", "entropy")}
    batch["old_logprobs"] = lps[0]["logprobs"] + 0.05 * batch["advantages"]
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0), entropy_coef=0.01)
    updates = [w.update(batch, alg, seed=5) for w in (plain, fast)]
    out["update"] = max(abs(b[k] - a[k]) / max(abs(a[k]), 1e-6) for a, b in zip(*updates)
                        for k in ("pg_loss", "entropy", "grad_norm"))
    ps.destroy_model_parallel()
    return out, out_tokens


def _mesh(tp: int, pp: int):
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    mesh = ParallelLayout(tp=tp, pp=pp, dp=2 // (tp * pp))
    initialize_model_parallel(mesh)
    return mesh


def _world(rank, world):
    from megatron.core import parallel_state as ps

    out = {"logprobs": {}, "attention": {}, "model": {}}
    plain = {}
    for tp in (1, 2):
        _mesh(tp, 1)
        out["logprobs"][tp], plain[tp] = _logprob_checks(tp)
        out.setdefault("positions", {})[tp] = _positions_checks(tp)
        out["attention"][tp] = _attention_checks(tp)
        ps.destroy_model_parallel()
    # the plain path at TP=2 against the same data on the full vocab (TP=1): this rank's rows of the weight
    v_local = plain[1][3].shape[0] // 2
    full = list(plain[1][:3]) + [plain[1][3][rank * v_local:(rank + 1) * v_local]]
    out["plain_tp2_vs_full"] = [_reldiff(p, q) for p, q in zip(full, plain[2])]
    for spec in (LLAMA, QWEN2):
        for tp, pp in MESHES:
            out["model"][(spec.family, tp, pp)] = _model_checks(spec, tp, pp)
    out["worker"], out["worker_tokens"] = _worker_checks()
    return out


@pytest.fixture(scope="module")
def world():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # the ranks run the Triton kernels on CPU tensors (read at import)
        return run_world(_world, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_logprobs_equal_plain_forward_and_gradients(world, tp, backend):
    for r in world:
        lp, ent, grad_hidden, grad_weight = r["logprobs"][tp][backend]
        assert max(lp, ent) <= 1e-6, (lp, ent)
        assert max(grad_hidden, grad_weight) <= 1e-6, (grad_hidden, grad_weight)


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_logprobs_on_chosen_positions_equal_plain_there_and_are_zero_elsewhere(world, tp):
    for r in world:  # log-prob, entropy, hidden and weight gradients; then |log-prob| and |entropy| elsewhere
        assert max(r["positions"][tp]) <= 1e-6, r["positions"][tp]


def test_actor_worker_computes_the_output_layer_on_response_tokens_only(world):
    for r in world:  # the log-prob pass of the fast worker: the response tokens' labels, not every position
        tokens = r["worker_tokens"]
        assert tokens["seen"] == tokens["response"] < tokens["all"], tokens


def test_plain_vocab_parallel_entropy_gradient_equals_the_full_vocab_one(world):
    for r in world:  # log-prob, entropy, hidden and weight gradients of a * logprob + c * entropy
        assert max(r["plain_tp2_vs_full"]) <= 1e-6, r["plain_tp2_vs_full"]


@pytest.mark.parametrize("window", [None, (3, 0)])
@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_attention_equals_local_attention(world, tp, window):
    for r in world:
        out, gq, gk, gv = r["attention"][tp][window]
        assert max(out, gq, gk, gv) <= 1e-5, (out, gq, gk, gv)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied / untied embeddings
@pytest.mark.parametrize("tp,pp", MESHES)
def test_model_with_kernels_equals_plain_model(world, family, tp, pp):
    results = [r["model"][(family, tp, pp)] for r in world]
    for res in results:
        assert res["grad_names"]
        assert res["grads"] <= 1e-5, res
    last = [res for res in results if "lp" in res]
    assert len(last) == 2 // pp
    for res in last:
        assert max(res["lp"], res["ent"]) <= 1e-5, res
        assert res["vocab_saved_plain"]  # the check can see a saved logits tensor...
        assert not res["vocab_saved_fast"], res  # ...and the chunked path saves none


def test_actor_worker_with_kernels_equals_it_without(world):
    for r in world:  # TP=2 with sequence parallelism: both ranks
        assert max(r["worker"].values()) <= 1e-5, r["worker"]
