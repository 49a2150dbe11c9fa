"""``python -m megarl.bench.packing``: the actor update over padded vs packed (THD) micro-batches.

Builds one actor (random weights of a preset shape: bf16 on the GPU, fp32 on the CPU; TP = PP = DP = 1) and a
batch of ``--rows`` sequences whose prompt and response lengths are drawn from ``--lengths``: a run's
``samples.jsonl`` (response tokens ``length`` or ``response_tokens``; prompt tokens ``prompt_tokens``, else
estimated as a quarter of the prompt's characters), or ``synth``, a GSM8K-like distribution (prompts uniform
in 100-200 tokens, responses ``64 + Exp(mean 250)`` capped at 1024: long-tailed). It then times the GRPO update
(forward, backward and optimizer step of the clipped policy loss, one mini-batch) over the same batch:

- ``padded``: the fixed-size path, ``--micro-batch-size`` rows per micro-batch, each as wide as the batch's
  longest sequence (default: as many rows as fit ``--budget`` tokens);
- ``packed``: ``actor.sequence_packing`` with ``max_tokens_per_micro_batch = --budget``.

and, with ``--long-tokens N`` (e.g. 16384), a third mode ``long``: ``--long-rows`` sequences of ``N`` tokens,
one per packed micro-batch, with its MFU (model FLOPs of :func:`megarl.measure.flops.train_flops`, attention
counted causally, over the datasheet bf16 peak of :func:`megarl.measure.flops.peak_bf16_flops`).

Output (``--out`` JSON, also printed): ``model``, ``device``, ``rows``, ``budget``, ``real_tokens``, and per
mode ``{seconds (mean per update), tokens_per_s (real tokens / s), padded_tokens (tokens the model ran),
micro_batches, peak_memory_bytes (torch.cuda.max_memory_allocated; null on the CPU)}``, ``packed_speedup``
(packed tokens/s over padded), and for ``long`` also ``flops`` and ``mfu``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from unittest import mock

import torch

from megarl.jsonl import latest_per_step, read_records


def sample_lengths(source: str, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_lens [rows], response_lens [rows])`` int64 drawn from ``source`` (``synth`` or a samples.jsonl;
    see the module docstring).

    Raises:
        ValueError: a samples file without any usable line.
    """
    g = torch.Generator().manual_seed(seed)
    if source == "synth":
        prompts = torch.randint(100, 201, (rows,), generator=g)
        responses = (64 + torch.empty(rows).exponential_(1 / 250, generator=g)).clamp(max=1024).long()
        return prompts, responses
    pairs = []
    records = read_records(source)  # a run's samples once each, however often a resume logged a step
    for rec in (records[i] for i in latest_per_step(records)):
        response = rec.get("response_tokens", rec.get("length"))
        prompt = rec.get("prompt_tokens", len(rec.get("prompt", "")) // 4)
        if response is not None and int(response) > 0:
            pairs.append((max(int(prompt), 1), int(response)))
    if not pairs:
        raise ValueError(f"--lengths {source}: no line with a response length ('length' or 'response_tokens')")
    pick = torch.randint(len(pairs), (rows,), generator=g)
    return torch.tensor([pairs[i][0] for i in pick]), torch.tensor([pairs[i][1] for i in pick])


def _batch(spec, prompt_lens: torch.Tensor, response_lens: torch.Tensor, seed: int):
    from megarl.data.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, spec.vocab_size, (int(p + r),), generator=g).tolist()
              for p, r in zip(prompt_lens, response_lens)]
    batch = build_batch([t[:int(p)] for t, p in zip(tokens, prompt_lens)],
                        [t[int(p):] for t, p in zip(tokens, prompt_lens)],
                        [torch.zeros(int(r)) for r in response_lens], list(range(len(tokens))), pad_token_id=0)
    advantages = torch.randn(len(tokens), 1, generator=g)  # GRPO: one advantage per sequence
    batch["advantages"] = advantages * batch["response_mask"]
    return batch


def _time_updates(worker, batch, alg, steps: int, warmup: int) -> dict:
    """Mean seconds of ``steps`` updates after ``warmup``, the peak memory, and the micro-batches' shapes."""
    cuda = torch.cuda.is_available()
    for i in range(warmup + steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        worker.update(batch, alg, seed=i)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    micro, _ = worker._micro_batches(batch, ("input_ids",), worker.rc.micro_batch_size)
    real = int((batch["prompt_lens"] + batch["response_lens"]).sum())
    return {"seconds": seconds, "tokens_per_s": real / seconds, "real_tokens": real,
            "padded_tokens": sum(m["input_ids"].numel() for m in micro), "micro_batches": len(micro),
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig
    from megarl.measure.flops import peak_bf16_flops, train_flops
    from megarl.models.spec import preset
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    initialize_model_parallel(ParallelLayout(), seed=0)
    spec = preset("tiny-llama" if args.model == "tiny" else args.model)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    prompt_lens, response_lens = sample_lengths(args.lengths, args.rows, args.seed)
    batch = _batch(spec, prompt_lens, response_lens, args.seed)
    width = batch["input_ids"].shape[1]
    mbs = args.micro_batch_size or max(1, args.budget // width)
    rcs = {"padded": ActorConfig(micro_batch_size=mbs, ppo_mini_batch_size=args.rows),
           "packed": ActorConfig(micro_batch_size=mbs, ppo_mini_batch_size=args.rows,
                                 max_tokens_per_micro_batch=args.budget, sequence_packing=True)}
    worker = PolicyWorker(spec, ParallelLayout(), "actor", "preset:random", dtype, rcs["padded"], trainable=True,
                          temperature=1.0)
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0))
    batch["old_logprobs"] = worker.compute_logprobs(batch)["logprobs"]
    out = {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "rows": args.rows, "budget": args.budget, "real_tokens": int((prompt_lens + response_lens).sum()),
           "lengths": args.lengths}
    for mode, rc in rcs.items():
        worker.rc = rc
        out[mode] = _time_updates(worker, batch, alg, args.steps, args.warmup)
    out["packed_speedup"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    if args.long_tokens:
        n = args.long_tokens
        prompts = torch.full((args.long_rows,), min(512, n // 2))
        long_batch = _batch(spec, prompts, n - prompts, args.seed)
        long_batch["old_logprobs"] = torch.zeros_like(long_batch["advantages"])
        worker.rc = ActorConfig(ppo_mini_batch_size=args.long_rows, max_tokens_per_micro_batch=n,
                                sequence_packing=True)
        res = _time_updates(worker, long_batch, alg, args.steps, args.warmup)
        res["flops"] = train_flops(spec, [n] * args.long_rows)
        peak = peak_bf16_flops()
        res["mfu"] = res["flops"] / res["seconds"] / peak if peak else None
        out["long"] = res
    return out


def main(argv: list[str] | None = None) -> dict:
    """Parse the arguments (``--help``), run the benchmark on one rank, print and write the JSON."""
    from megarl.parallel.launch import run_world

    p = argparse.ArgumentParser(prog="python -m megarl.bench.packing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (tiny-llama) or a preset of megarl.models.spec.PRESETS, "
                   "e.g. qwen2.5-1.5b or 'qwen2.5-1.5b?layers=4'")
    p.add_argument("--lengths", default="synth", help="'synth' (GSM8K-like) or a samples.jsonl")
    p.add_argument("--rows", type=int, default=64, help="sequences in the batch (one mini-batch)")
    p.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch")
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="rows per padded micro-batch (0 = as many as fit --budget at the batch's width)")
    p.add_argument("--steps", type=int, default=3, help="timed updates per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates per mode first")
    p.add_argument("--long-tokens", type=int, default=0, help="also time sequences of this many tokens, one per "
                   "micro-batch, with MFU (e.g. 16384; 0 = off)")
    p.add_argument("--long-rows", type=int, default=2, help="sequences of the long mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here")
    hide_gpus = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}  # the spawned rank sees none
    with mock.patch.dict(os.environ, hide_gpus):
        out = run_world(_bench_rank, 1, args)[0]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
