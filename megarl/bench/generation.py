"""``megarl bench generation [CONFIG.yaml] [key=value ...]``: where the rollout engine's generation time goes.

One vLLM rollout engine per process (vLLM's state is process-global), built as the trainer builds it
(:func:`megarl.trainer.builders.make_engine`: the config's ``rollout.*`` knobs, :class:`~megarl.rollout.
vllm_engine.VLLMSettings`) on the model of ``model.path`` with dummy weights (a throughput benchmark: what the
weights are does not matter, random models rarely sample their EOS, so responses run to ``max_new_tokens``),
on one GPU (``rollout.tp`` 1). The batch is an RL step's: ``data.prompts_per_step`` prompts of 3-5 random
token ids, ``rollout.n`` samples each, at most ``rollout.max_new_tokens`` tokens, at ``rollout.temperature``.

After one untimed call (warm-up), each *variant* of what megarl asks vLLM for per token generates the whole
batch ``--repeats`` times (the median run is reported):

- ``megarl``: :meth:`~megarl.rollout.vllm_engine.VLLMRolloutEngine.generate` itself (the RL path: seeded
  requests when ``rollout.request_seeds``, the sampled token's log-prob, the EOS and stop ids, and megarl's
  own conversion of vLLM's outputs into samples);
- ``raw``: the same requests through ``vllm.LLM.generate`` (without megarl's conversion);
- ``no_seeds``, ``no_logprobs``, ``no_stop``: ``raw`` without per-request seeds, without the log-prob, without
  stop ids (each alone); ``bare``: without all three.

Each run is cut into engine steps by timers around vLLM 0.24's engine-core calls (read in
``vllm/v1/engine/core.py``, ``core_client.py``, ``llm_engine.py``): ``schedule`` (the scheduler), ``execute``
and ``sample`` (launching the forward pass and the sampler; with async scheduling they return futures),
``wait`` (the host blocked on the GPU's results: near zero when the host is the bottleneck), ``update`` (the
scheduler taking the sampled tokens in) and ``output`` (the output processor: detokenizer and log-prob
objects); ``other`` is the rest of the wall time. NVML samples the GPU's utilisation during the runs.

``--profile-tokens N`` then profiles the first variant on ``N`` new tokens with the torch profiler (CUDA
kernels through CUPTI, CUDA-graph kernels included): GPU busy time (the union of kernel intervals) against
the wall time, per engine step; kernel time by kind (GEMM, attention, sampling, other); with the V1 model runner
also vLLM's own scopes (``VLLM_CUSTOM_SCOPES_FOR_PROFILING``: ``gpu_model_runner: forward``, ``sample``, ...)
with their host and device time.

Output: a table and one JSON (``--json``): ``label``, ``model``, ``settings`` (the VLLMSettings), ``vllm``
(what vLLM resolved them to: :func:`resolved_settings`),
``enforce_eager``, ``batch`` (prompts, n, max_new_tokens), ``init_s``, ``variants`` (``{name: {tokens,
seconds, tokens_per_s, runs_s, steps, per_step_ms: {wall, schedule, execute, sample, wait, update, output,
other}, gpu_util_mean_pct}}``), ``profile`` (``steps``, ``wall_ms_per_step``, ``gpu_busy_ms_per_step``,
``gpu_idle_frac``, ``kernels_ms_per_step`` by kind, ``scopes``). Units: seconds, milliseconds per engine step,
tokens, percent.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from megarl.config import Config
from megarl.output_folder import write_beside

VARIANTS = {  # name -> (through megarl's engine.generate, per-request seeds, log-prob, stop ids)
    "megarl": (True, True, True, True),
    "raw": (False, True, True, True),
    "no_seeds": (False, False, True, True),
    "no_logprobs": (False, True, False, True),
    "no_stop": (False, True, True, False),
    "bare": (False, False, False, False),
}
STEP_PARTS = ("schedule", "execute", "sample", "wait", "update", "output")
KERNEL_KINDS = {  # kernel name fragments (lower case) -> kind; the first match wins
    "attention": ("flash", "fmha", "attn", "paged"),
    "gemm": ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "splitk", "scaled_mm", "fp8"),
    "sampling": ("softmax", "exponential", "argmax", "topk", "sort", "gumbel", "sample", "count_greater",
                 "gather", "scatter", "cumsum", "logprob"),
}


def model_spec(path: str):
    """The model of ``model.path`` from its config alone: a preset's spec, or the config of an HF directory (no
    weight files needed: the engine runs dummy weights), a GGUF file or a megarl checkpoint."""
    from megarl.models import checkpoint as ck
    from megarl.models.spec import ModelSpec

    source = None if path == "default" else path
    config = ck.source_config(source)
    return ck.source_spec(source)[0] if config is None else ModelSpec.from_hf_config(config)


def synthetic_prompts(num: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of 3 to 5 token ids drawn uniformly from ``[0, vocab_size)`` (the synthetic task's
    lengths of :mod:`tests.rl_tasks`), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 6, (num,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


class StepTimers:
    """Host seconds spent in each of :data:`STEP_PARTS` of vLLM 0.24's engine loop, installed by wrapping the
    in-process engine core's objects (module docstring); counts the engine steps that ran the model."""

    def __init__(self, llm):
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        self._wrap(core.scheduler, "schedule", "schedule", count=True)
        self._wrap(core.scheduler, "update_from_output", "update")
        self._wrap(core.model_executor, "execute_model", "execute", future=True)
        self._wrap(core.model_executor, "sample_tokens", "sample", future=True)
        self._wrap(llm.llm_engine.output_processor, "process_outputs", "output")

    def _timed(self, fn: Callable, part: str) -> Callable:
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t
        return run

    def _wrap(self, obj, name: str, part: str, *, count: bool = False, future: bool = False) -> None:
        inner = getattr(obj, name)
        timed = self._timed(inner, part)

        def wrapper(*args, **kwargs):
            out = timed(*args, **kwargs)
            if count and getattr(out, "total_num_scheduled_tokens", 0) > 0:
                self.steps += 1
            if future and hasattr(out, "result"):
                out.result = self._timed(out.result, "wait")
            return out
        setattr(obj, name, wrapper)

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0


def _requests(engine, prompts, sampling, seeds: bool, logprobs: bool, stop: bool):
    """The rollout engine's requests (:func:`~megarl.rollout.vllm_engine.request_params`) with the per-token
    asks of a variant removed."""
    from vllm import SamplingParams, TokensPrompt

    from megarl.rollout.base import sample_rows, sample_seed
    from megarl.rollout.vllm_engine import request_params

    context = engine.spec.max_position_embeddings
    ids = sorted(set(engine.spec.eos_token_ids) | set(sampling.stop_token_ids)) if stop else []
    rows = sample_rows(len(prompts), sampling.n)
    params = []
    for k, j in rows:
        kw = request_params(prompts[k], sampling, context=context, stop_token_ids=ids,
                            seed=sample_seed(sampling.seed, 0, k, j) if seeds else None)
        if not logprobs:
            kw["logprobs"] = None
        if not stop:
            kw["ignore_eos"] = True
        params.append(SamplingParams(**kw))
    return [TokensPrompt(prompt_token_ids=prompts[k]) for k, _ in rows], params


def _generate(engine, variant: str, prompts, sampling) -> int:
    """One call of ``variant``; returns the tokens generated."""
    through_engine, seeds, logprobs, stop = VARIANTS[variant]
    if through_engine:
        return engine.generate(prompts, sampling).stats.generated_tokens
    reqs, params = _requests(engine, prompts, sampling, seeds, logprobs, stop)
    return sum(len(o.outputs[0].token_ids) for o in engine.llm.generate(reqs, params, use_tqdm=False))


def resolved_settings(llm) -> dict[str, Any]:
    """What vLLM made of the knobs (its ``VllmConfig`` after construction): the model runner, async scheduling,
    batch limits, the largest CUDA-graph batch, the weights' quantisation and the KV cache's dtype."""
    c = llm.llm_engine.vllm_config
    sched, comp = c.scheduler_config, c.compilation_config
    sizes = comp.cudagraph_capture_sizes or []
    return {"v2_model_runner": bool(c.use_v2_model_runner), "async_scheduling": bool(sched.async_scheduling),
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "cudagraph_sizes": len(sizes), "max_cudagraph_capture_size": max(sizes) if sizes else 0,
            "quantization": c.model_config.quantization, "kv_cache_dtype": c.cache_config.cache_dtype}


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS.items() if any(k in low for k in keys)), "other")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_generation(engine, timers: StepTimers, variant: str, prompts, sampling) -> dict[str, Any]:
    """The first ``sampling.max_new_tokens`` tokens of ``variant`` under the torch profiler: GPU busy vs wall time
    per engine step, kernel time by kind, vLLM's scopes (module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    timers.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        _generate(engine, variant, prompts, sampling)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    steps = max(timers.steps, 1)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_kind: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kind[_kind(e.name)] += e.time_range.elapsed_us()
    busy_ms = _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3
    scopes = {e.key: {"host_ms_per_step": e.cpu_time_total / 1e3 / steps,
                      "device_ms_per_step": e.device_time_total / 1e3 / steps, "calls": e.count}
              for e in prof.key_averages() if e.key.startswith(("gpu_model_runner", "llm_engine"))}
    return {"variant": variant, "new_tokens": sampling.max_new_tokens, "steps": timers.steps,
            "wall_ms_per_step": wall * 1e3 / steps, "gpu_busy_ms_per_step": busy_ms / steps,
            "gpu_idle_frac": max(0.0, 1 - busy_ms / (wall * 1e3)), "kernels": len(kernels),
            "kernels_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(by_kind.items())}, "scopes": scopes,
            "host_ms_per_step": {p: timers.seconds[p] * 1e3 / steps for p in STEP_PARTS}}


@contextmanager
def _utilization():
    from megarl.measure.monitor import UtilizationSampler

    with UtilizationSampler(0.05) as sampler:
        yield sampler


def bench_generation(cfg: Config, *, label: str, variants: list[str], repeats: int = 1, profile_tokens: int = 0,
                     json_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Build the rollout engine of ``cfg`` and measure ``variants`` (module docstring).

    Args:
        label: names this engine's configuration in the report.
        variants: names of :data:`VARIANTS`, in order (the first one is profiled).
        repeats: timed calls per variant (the median is reported).
        profile_tokens: new tokens of the profiled call; 0: no profile.

    Returns:
        The report (module docstring); written to ``json_path`` when given.

    Raises:
        ValueError: an unknown variant. Whatever the engine raises (no GPU, vLLM missing, a bad setting).
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")  # vLLM's record_function scopes (V1 runner)
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMSettings
    from megarl.trainer.builders import make_engine

    spec = model_spec(cfg.model.path)
    r = cfg.rollout
    start = time.perf_counter()
    engine = make_engine(cfg, spec)
    init_s = time.perf_counter() - start
    engine.update_weights(lambda params: None)  # the dummy weights stay: a throughput benchmark
    timers = StepTimers(engine.llm)
    prompts = synthetic_prompts(cfg.data.prompts_per_step, spec.vocab_size, cfg.run.seed)
    sampling = SamplingConfig(n=r.n, temperature=r.temperature, max_new_tokens=r.max_new_tokens, seed=cfg.run.seed)
    _generate(engine, variants[0], prompts, sampling)  # warm-up
    report: dict[str, Any] = {
        "vllm": resolved_settings(engine.llm),
        "label": label, "model": cfg.model.path, "settings": VLLMSettings.from_config(r).as_dict(),
        "enforce_eager": r.enforce_eager, "gpu_memory_utilization": r.gpu_memory_utilization,
        "max_model_len": engine.spec.max_position_embeddings, "device": torch.cuda.get_device_name(),
        "batch": {"prompts": len(prompts), "n": r.n, "max_new_tokens": r.max_new_tokens}, "init_s": init_s,
        "variants": {}}
    for name in variants:
        runs = []
        for _ in range(repeats):
            gc.collect()
            engine.llm.reset_prefix_cache()  # as at every wake-up of the rollout engine
            timers.reset()
            with _utilization() as sampler:
                t = time.perf_counter()
                tokens = _generate(engine, name, prompts, sampling)
                seconds = time.perf_counter() - t
            parts = {p: timers.seconds[p] for p in STEP_PARTS}
            runs.append((seconds, tokens, timers.steps, parts, sampler.samples.summary()))
        seconds, tokens, steps, parts, util = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
        per = {"wall": seconds * 1e3 / max(steps, 1), **{p: v * 1e3 / max(steps, 1) for p, v in parts.items()}}
        per["other"] = per["wall"] - sum(per[p] for p in STEP_PARTS)
        report["variants"][name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                                    "runs_s": [x[0] for x in runs], "steps": steps, "per_step_ms": per,
                                    "gpu_util_mean_pct": util.get("util_mean_pct")}
    if profile_tokens:
        short = SamplingConfig(n=r.n, temperature=r.temperature, max_new_tokens=profile_tokens, seed=cfg.run.seed)
        engine.llm.reset_prefix_cache()
        report["profile"] = profile_generation(engine, timers, variants[0], prompts, short)
    if json_path:  # claimed before the engine started (megarl.cli.bench)
        write_beside(json_path, lambda tmp: tmp.write_text(json.dumps(report, indent=2)), "bench generation")
    print(format_table(report), flush=True)
    return report


def format_table(report: dict[str, Any]) -> str:
    """One row per variant: tokens/s, engine steps, ms per step in each part, GPU utilisation; then the
    profile's GPU busy and idle per step."""
    head = ("variant", "tokens/s", "s", "steps", "ms/step", *STEP_PARTS, "other", "GPU util %")
    rows = [head]
    for name, v in report["variants"].items():
        p = v["per_step_ms"]
        rows.append((name, f"{v['tokens_per_s']:,.0f}", f"{v['seconds']:.2f}", str(v["steps"]), f"{p['wall']:.2f}",
                     *(f"{p[k]:.2f}" for k in STEP_PARTS), f"{p['other']:.2f}",
                     "-" if v["gpu_util_mean_pct"] is None else f"{v['gpu_util_mean_pct']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"{report['label']}: {report['model']}, {report['batch']}, settings "
             f"{ {k: v for k, v in report['settings'].items() if v is not None} }, init {report['init_s']:.0f} s",
             f"vLLM resolved: {report['vllm']}"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    prof = report.get("profile")
    if prof:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in prof["kernels_ms_per_step"].items())
        lines.append(f"profile ({prof['variant']}, {prof['new_tokens']} tokens, {prof['steps']} steps): wall "
                     f"{prof['wall_ms_per_step']:.2f} ms/step, GPU busy {prof['gpu_busy_ms_per_step']:.2f} (idle "
                     f"{prof['gpu_idle_frac']:.0%}); kernels ms/step: {kinds}")
        for key, s in prof["scopes"].items():
            lines.append(f"  {key}: host {s['host_ms_per_step']:.2f} ms/step, device {s['device_ms_per_step']:.2f}")
    return "\n".join(lines)


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    return report if report.get("status", "ok") == "ok" else None


def summary_table(folder: str | os.PathLike) -> str:
    """The markdown summary of ``perf/gpu_generation.sh``'s reports in ``folder`` (``gen_*.json`` of
    :func:`bench_generation`, ``step_*.json`` of ``megarl bench step``; missing ones are skipped): generation
    before/after with the issue's goal (1.8x), the per-step breakdowns and profiles, FP8 against bf16, the RL step
    against 7.0 s, the standalone baseline's spread against 5%, the HF-directory config against the preset."""
    folder = Path(folder)
    gens = {label: r for label in ("before", "after", "fp8", "fp8kv", "hf", "sync", "7b", "7b_fp8", "lp_output",
                                   "lp_sampler", "lp_v1_output", "lp_v1_sampler")
            if (r := _load(folder, f"gen_{label}.json")) is not None}
    steps = {label: r for label in ("before", "after", "fp8", "engines2", "fp8kv")
             if (r := _load(folder, f"step_{label}.json")) is not None}
    out = ["## Generation, one engine per row (megarl bench generation)", "",
           "| engine | vLLM resolved | variant | tokens/s | s | steps | ms/step | " + " | ".join(STEP_PARTS)
           + " | other | GPU util % |", "|" + "---|" * (10 + len(STEP_PARTS))]
    for label, r in gens.items():
        v = r["vllm"]
        kv = v.get("kv_cache_dtype", "auto")  # reports before 2026-12-07 lack it
        resolved = (f"{'V2' if v['v2_model_runner'] else 'V1'} runner, async {'on' if v['async_scheduling'] else 'off'}, "
                    f"{v['max_num_seqs']} seqs, graphs to {v['max_cudagraph_capture_size']}, {v['quantization'] or 'bf16'}"
                    + (f", KV {kv}" if kv != "auto" else ""))
        for name, x in r["variants"].items():
            p = x["per_step_ms"]
            out.append(f"| {label} | {resolved} | {name} | {x['tokens_per_s']:,.0f} | {x['seconds']:.2f} | {x['steps']} | "
                       f"{p['wall']:.2f} | " + " | ".join(f"{p[k]:.2f}" for k in STEP_PARTS) +
                       f" | {p['other']:.2f} | {x['gpu_util_mean_pct'] or 0:.0f} |")
    if "before" in gens and "after" in gens:
        a, b = gens["after"]["variants"]["megarl"], gens["before"]["variants"]["megarl"]
        speedup = a["tokens_per_s"] / b["tokens_per_s"]
        out += ["", f"RL generate call (variant megarl): {b['seconds']:.2f} s before, {a['seconds']:.2f} s after: "
                    f"{speedup:.2f}x (goal >= 1.8x: {'met' if speedup >= 1.8 else 'missed'})"]
    for runner in ("", "v1_"):  # rollout.logprobs: output against sampler (gen_logprobs, gen_logprobs_v1)
        if f"lp_{runner}output" in gens and f"lp_{runner}sampler" in gens:
            o, s = (gens[f"lp_{runner}{k}"]["variants"]["megarl"] for k in ("output", "sampler"))
            out.append(f"rollout.logprobs ({runner[:-1] or 'AFTER'}): output {o['seconds']:.2f} s "
                       f"({o['per_step_ms']['wall']:.2f} ms/step), sampler {s['seconds']:.2f} s "
                       f"({s['per_step_ms']['wall']:.2f} ms/step): {o['seconds'] / s['seconds']:.2f}x")
    if "before" in gens:
        v = gens["before"]["variants"]
        base = v["megarl"]["tokens_per_s"]
        asks = ", ".join(f"{n}: {x['tokens_per_s'] / base:.2f}x" for n, x in v.items() if n != "megarl")
        out.append(f"per-token asks on the before engine, tokens/s against megarl's: {asks}")
    out += ["", "## GPU busy vs idle per engine step (torch profiler, the first variant, 32 new tokens)", ""]
    for label, r in gens.items():
        p = r.get("profile")
        if p:
            kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in p["kernels_ms_per_step"].items())
            out.append(f"- {label}: {p['wall_ms_per_step']:.2f} ms/step wall, GPU busy {p['gpu_busy_ms_per_step']:.2f} "
                       f"(idle {p['gpu_idle_frac']:.0%}); kernels ms/step: {kinds}")
            out += [f"  - {k}: host {s['host_ms_per_step']:.2f}, device {s['device_ms_per_step']:.2f} ms/step"
                    for k, s in p["scopes"].items()]
    if steps:
        out += ["", "## The RL step (megarl bench step, grpo-1.5b-fast)", "",
                "| run | step s | generate s | generate tokens/s | reshard s | rollout vs old log-prob | k3 KL | TIS "
                "truncated | standalone tokens/s (passes) | spread | ratio |", "|" + "---|" * 11]
        for label, r in steps.items():
            ph, q, s = r["phases"], r.get("rollout") or {}, r.get("standalone_vllm") or {}
            passes = ", ".join(f"{x:,.0f}" for x in s.get("tokens_per_s_runs") or [])
            out.append(f"| {label} | {r['step_time_s']:.2f} | {ph['generate']['time_s']:.2f} | "
                       f"{r['generate_tokens_per_s'] or 0:,.0f} | {ph.get('reshard', {}).get('time_s', 0):.3f} | "
                       f"{q.get('rollout_vs_old_logprob_diff', float('nan')):.4f} | {q.get('kl_k3', float('nan')):.2e} | "
                       f"{q.get('truncated_frac', float('nan')):.2%} | {s.get('tokens_per_s') or 0:,.0f} ({passes}) | "
                       f"{s.get('spread', float('nan')):.1%} | {s.get('ratio') or float('nan'):.3f} |")
        if "after" in steps:
            r = steps["after"]
            s = (r.get("standalone_vllm") or {}).get("spread")
            out.append(f"\nstep after: {r['step_time_s']:.2f} s (goal <= 7.0 s: {'met' if r['step_time_s'] <= 7.0 else 'missed'}); "
                       f"standalone spread {'-' if s is None else f'{s:.1%}'} (goal <= 5%: "
                       f"{'met' if s is not None and s <= 0.05 else 'missed'})")
    if "engines2" in steps and "after" in steps:  # rollout.engines_per_gpu=2 against one engine
        two, one = steps["engines2"], steps["after"]
        out.append(f"\ntwo engines on the GPU vs one: step {two['step_time_s']:.2f} vs {one['step_time_s']:.2f} s, "
                   f"generate {two['phases']['generate']['time_s']:.2f} vs {one['phases']['generate']['time_s']:.2f} s "
                   f"({one['phases']['generate']['time_s'] / two['phases']['generate']['time_s']:.2f}x)")
    for label, what in (("fp8", "FP8 vs bf16 weights"), ("fp8kv", "FP8 vs bf16 KV cache")):
        if label in gens and "after" in gens:
            f, b = gens[label]["variants"]["megarl"], gens["after"]["variants"]["megarl"]
            out.append(f"\n{what}, generation (after settings): {f['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} "
                       f"tokens/s ({f['tokens_per_s'] / b['tokens_per_s']:.2f}x)")
    if "fp8kv" in steps and "after" in steps:
        k, b = steps["fp8kv"], steps["after"]
        out.append(f"FP8 KV cache vs bf16, the step: {k['step_time_s']:.2f} vs {b['step_time_s']:.2f} s, generate "
                   f"{k['phases']['generate']['time_s']:.2f} vs {b['phases']['generate']['time_s']:.2f} s")
    if "7b" in gens and "7b_fp8" in gens:
        f, b = gens["7b_fp8"]["variants"]["megarl"], gens["7b"]["variants"]["megarl"]
        out.append(f"FP8 vs bf16 generation, Qwen2.5-7B shape: {f['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} "
                   f"tokens/s ({f['tokens_per_s'] / b['tokens_per_s']:.2f}x)")
    if "hf" in gens and "before" in gens:
        h, b = gens["hf"], gens["before"]
        out.append(f"HF config.json (context {h['max_model_len']}) vs the preset (context {b['max_model_len']}), main's "
                   f"settings: {h['variants']['megarl']['tokens_per_s']:,.0f} vs "
                   f"{b['variants']['megarl']['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(out)
