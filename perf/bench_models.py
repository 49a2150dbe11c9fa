"""Forward + backward of megarl's Megatron actor builder on one GPU (or the CPU), bf16 on GPU.

    python perf/bench_models.py --model qwen2.5-0.5b --micro-batch 8 --seq 2048 --steps 5 [--json OUT]
        [--attention sdpa|local|te] [--fp8] [--chunked-logprob|--no-chunked-logprob] [--compare-plain]

Builds the named model shape (random init) with :func:`megarl.models.megatron.build_model` on a TP=1 x PP=1
mesh, runs ``--steps`` timed forward+backward passes (after one warm-up) through megatron's
``forward_backward_func`` with the token-mean log-prob loss the trainer uses, and reports seconds per pass,
tokens/s, model TFLOP/s and MFU (:func:`megarl.measure.flops.train_flops`: 6 x matmul params x tokens plus
causal attention, against ``--peak-tflops``, 989 for an H200's dense bf16), peak memory, and that the loss and
gradients are finite.

The loss is ``-mean(log-prob) - 0.01 mean(entropy)`` (the actor update computes both). ``--attention`` and
``--chunked-logprob`` pick the ``kernels/`` fast paths as the trainer's ``actor.kernels`` does (default: both on);
``--attention te`` builds Transformer Engine's layer spec instead of the local one (TE must import), and ``--fp8``
runs it with megatron's FP8 training (hybrid E4M3/E5M2, per-tensor current scaling);
``--compare-plain`` then also runs one forward+backward of the same weights and tokens (the first
``--compare-rows`` rows) through the plain path (local attention, full logits + ``vocab_parallel_logprobs``) and
reports the largest differences of log-probs, entropy and gradients.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megarl.kernels.chunked_logprobs import LogprobOutput
from megarl.measure.flops import train_flops
from megarl.models.logprobs import vocab_parallel_logprobs
from megarl.models.megatron import build_model
from megarl.models.pipeline import run_microbatches
from megarl.models.spec import preset
from megarl.parallel.launch import run_world
from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel


def _fwd_bwd(model, tokens, spec, chunked: bool, chunk_tokens: int, backend: str = "auto"):
    """One forward+backward of ``-mean(log-prob) - 0.01 mean(entropy)``; returns the metrics of the pass."""
    kwargs = None
    if chunked:
        kwargs = {"output_processor": LogprobOutput(vocab_size=spec.vocab_size, with_entropy=True,
                                                    chunk_tokens=chunk_tokens, backend=backend)}

    def loss_fn(mb, out):
        if chunked:
            logp, ent = out
        else:
            labels = torch.roll(mb["input_ids"], -1, dims=1)
            logp, ent = vocab_parallel_logprobs(out, labels, vocab_size=spec.vocab_size, with_entropy=True)
        loss = -logp.mean() - 0.01 * ent.mean()
        return loss, {"loss": loss.detach().float(), "logprobs": logp.detach(), "entropy": ent.detach()}

    for p in model.parameters():
        p.grad = None
    return run_microbatches(model, [{"input_ids": tokens}], loss_fn, forward_only=False, model_kwargs=kwargs)[0]


def _compare_plain(model, tokens, spec, a, mesh, dtype) -> dict:
    """The kernels' pass against the plain path on the same weights and tokens: largest absolute differences
    of log-probs and entropy, and of each gradient relative to that gradient's largest entry; on the GPU also
    the chunked path's Triton kernels against its torch ops."""
    plain = build_model(spec, mesh, params_dtype=dtype, recompute=a.recompute, attention="local",
                        init_weights=False).to(tokens.device)
    plain.load_state_dict(model.state_dict())
    fast = _fwd_bwd(model, tokens, spec, a.chunked_logprob, a.chunk_tokens)
    ref = _fwd_bwd(plain, tokens, spec, False, a.chunk_tokens)
    grads = {n: (p.grad.float(), dict(model.named_parameters())[n].grad.float()) for n, p in plain.named_parameters()}
    worst = max(grads, key=lambda n: float((grads[n][0] - grads[n][1]).abs().max() / grads[n][0].abs().max()))
    g_ref, g_fast = grads[worst]
    res = {"rows": tokens.shape[0], "max_abs_diff_logprobs": float((fast["logprobs"] - ref["logprobs"]).abs().max()),
           "mean_abs_diff_logprobs": float((fast["logprobs"] - ref["logprobs"]).abs().mean()),
           "max_abs_diff_entropy": float((fast["entropy"] - ref["entropy"]).abs().max()),
           "max_rel_diff_grad": float((g_ref - g_fast).abs().max() / g_ref.abs().max()), "max_rel_diff_grad_param": worst,
           "loss": [float(ref["loss"]), float(fast["loss"])]}
    del plain, grads, g_ref, g_fast
    if a.chunked_logprob and tokens.is_cuda:
        torch_ops = _fwd_bwd(model, tokens, spec, True, a.chunk_tokens, backend="torch")
        res["max_abs_diff_logprobs_triton_vs_torch"] = float((fast["logprobs"] - torch_ops["logprobs"]).abs().max())
        res["max_abs_diff_entropy_triton_vs_torch"] = float((fast["entropy"] - torch_ops["entropy"]).abs().max())
    return res


def _bench(rank, world, a):
    spec = preset(a.model)
    if a.layers:
        spec = spec.replace(num_layers=a.layers)
    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    te = a.attention == "te"
    model = build_model(spec, mesh, params_dtype=dtype, recompute=a.recompute, use_te=te,
                        attention="sdpa" if te else a.attention, fp8="hybrid" if a.fp8 else None)
    if gpu:
        model = model.cuda()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (a.micro_batch, a.seq), generator=g).to(device)

    def once():
        return _fwd_bwd(model, tokens, spec, a.chunked_logprob, a.chunk_tokens)

    try:
        once()  # warm-up
    except torch.OutOfMemoryError as e:  # a result too: the plain path's fp32 logit copies do not fit
        return {"model": a.model, "micro_batch": a.micro_batch, "seq": a.seq, "attention": a.attention, "fp8": a.fp8,
                "chunked_logprob": a.chunked_logprob, "status": "out of memory", "error": str(e).splitlines()[0]}
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        out = once()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    n_tok = a.micro_batch * a.seq
    sec = sorted(times)[len(times) // 2]
    flops = train_flops(spec, [a.seq] * a.micro_batch)  # forward + backward, causal attention
    res = {
        "model": a.model, "layers": spec.num_layers, "params": spec.num_params(), "dtype": str(dtype),
        "device": torch.cuda.get_device_name() if gpu else "cpu", "micro_batch": a.micro_batch, "seq": a.seq,
        "recompute": a.recompute, "seconds_per_fwd_bwd_median": sec, "tokens_per_s": n_tok / sec,
        "model_tflops_per_s": flops / sec / 1e12, "mfu": flops / sec / 1e12 / a.peak_tflops,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "loss": float(out["loss"]), "loss_finite": bool(torch.isfinite(out["loss"])),
        "grads_finite": grads_finite, "attention": a.attention, "fp8": a.fp8, "chunked_logprob": a.chunked_logprob,
        "chunk_tokens": a.chunk_tokens, "status": "ok",
    }
    if a.compare_plain:
        res["compare_plain"] = _compare_plain(model, tokens[:a.compare_rows], spec, a, mesh, dtype)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0 = all)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--attention", choices=("sdpa", "local", "te"), default="sdpa",
                   help="core attention of the local spec (kernels/), or te: Transformer Engine's layer spec")
    p.add_argument("--fp8", action="store_true", help="FP8 training (with --attention te)")
    p.add_argument("--chunked-logprob", action=argparse.BooleanOptionalAction, default=True,
                   help="output layer + log-prob/entropy in chunks of tokens (kernels/)")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per log-prob chunk")
    p.add_argument("--compare-plain", action="store_true",
                   help="also report the differences to the plain path on the same weights")
    p.add_argument("--compare-rows", type=int, default=2, help="rows of the batch that --compare-plain runs")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU, TFLOP/s")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = run_world(_bench, 1, a)[0]
    for k, v in res.items():
        print(f"{k:28s} {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["status"] == "ok" and res["loss_finite"] and res["grads_finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
