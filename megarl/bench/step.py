"""``megarl bench step CONFIG.yaml [key=value ...] --steps N --warmup K [--json PATH]``: the RL step, phase by phase.

Builds the real :class:`~megarl.trainer.trainer.Trainer` from the config (random weights with
``model.path=preset:NAME``, or a real model), runs ``K`` warm-up steps and ``N`` measured steps, and reports
per phase (the rollout engine's wake-up, reshard, generate, reward, old log-probs, reference, values,
advantages, critic update, actor update): seconds per step, tokens per step, tokens/s and tokens/s/GPU, MFU
for the model passes and peak memory. Tokens and model FLOPs of each phase are those of :mod:`megarl.measure.throughput` (real sequence
lengths, causal attention, formulas and sources in :mod:`megarl.measure.flops`); MFU is reported against the
device's datasheet dense bf16 peak (``mfu``; H100/H200 SXM: 989.4 TFLOP/s) and, where one was measured,
against the measured bf16 matmul rate (``mfu_vs_measured``; H200: 794 TFLOP/s, GPU.md). ``--peak-tflops``
replaces the datasheet figure (a device missing from the table, or the CPU). Peak memory is
``torch.cuda.max_memory_allocated`` per phase on a GPU (torch's tensors; vLLM's own mappings are not in it)
and the process's peak resident memory on the CPU, the maximum over ranks. GPU utilisation and device memory
are sampled with NVML in a background thread during the measured steps (CPU use and resident memory of the
process on the CPU).

Output: a table on the console and one JSON (``--json``; default ``<run folder>/bench_step.json``), written
by rank 0 (beside, then renamed into place; an existing one is replaced only with ``--overwrite``, checked
before the run by :mod:`megarl.cli.bench`), that ``megarl sweep`` collects. Its keys:

- ``status``: "ok", "oom" (CUDA out of memory) or "error" (then ``error`` holds the message);
- ``config``: ``path``, ``overrides``, ``layout`` (tp, pp, dp, world size, rollout engine and tp, model,
  dtype, batch sizes) and ``resolved`` (the whole config);
- ``world_size``, ``device``, ``peak_tflops`` (``datasheet``, ``measured``: per GPU), ``steps``, ``warmup``;
- ``machine``: what ran it, for the speed gate's history (:mod:`megarl.bench.gate`): ``gpu``, ``gpus``, ``host``,
  ``torch``, ``cuda``, ``vllm`` (None where not installed) and ``commit`` (the checkout's ``git rev-parse
  HEAD``, else None);
- ``parameters``: ``model`` (the base model's), ``adapters`` (LoRA's, 0 without) and ``trainable`` (what an update
  trains: the adapters with ``actor.lora``, else every weight);
- ``step_time_s`` (mean over the measured steps), ``tokens_per_s`` and ``tokens_per_s_per_gpu`` (prompt +
  response tokens of the batch over the step), ``generate_tokens_per_s``, ``mfu``, ``mfu_vs_measured`` (all
  model FLOPs of the step over the step), ``peak_memory_bytes`` (largest phase peak);
- ``phases``: ``{name: {time_s, tokens, tokens_per_s, tokens_per_s_per_gpu, flops, mfu, mfu_vs_measured,
  peak_memory_bytes}}``, ``time_s`` and ``tokens`` per step (means), rates over the measured steps (sums over
  sums); ``tokens``/rates/``flops``/``mfu`` are null for phases without them (reshard, advantages);
- ``gpu_util``: ``source`` ("nvml" or "proc"), ``util_mean_pct``, ``util_max_pct``, ``memory_max_bytes``
  (over ranks) and ``per_rank`` (each rank's summary, :meth:`~megarl.measure.monitor.Samples.summary`);
- ``pools``: ``{"train": {busy_s, idle_s}, "rollout": {busy_s, idle_s}}`` per step (means; the trainer's
  ``pool/*`` metrics: busy = the pool's own work, idle = the step less that and the reshard), which shows the
  overlap of ``trainer.mode=async`` with ``placement.rollout`` on a pool of its own (``layout`` records
  ``mode``, ``max_staleness`` and ``rollout_pool``; ``wait_rollout`` is then the training ranks' wait for a
  batch, and ``generate`` the rollout pool's seconds, beside the other phases);
- ``per_step``: the seconds of every phase of every measured step;
- ``rollout``: means over the measured steps of the rollout's agreement with the actor (present when the
  trainer logs them): ``rollout_vs_old_logprob_diff`` (mean |rollout - old log-prob| of response tokens),
  ``kl_k3`` and ``truncated_frac`` (``rollout_corr/*``: the k3 KL of rollout vs old, the share of tokens whose
  TIS weight was cut), the quantity FP8 rollouts change, and ``token_mult_prob_error``, ``gen_kl_error``,
  ``abs_diff_max``, ``abs_diff_p99`` (``mismatch/*``: :mod:`megarl.algos.mismatch`);
- ``overlap``: with ``rollout.overlap_scoring``, the means over the measured steps of ``units``, ``early_units``
  (scored before the last sample), ``scoring_s`` and ``wait_s`` (:mod:`megarl.rollout.overlap`); else empty;
- with ``--standalone-vllm`` (vLLM rollouts), ``standalone_vllm``: rank 0's generate calls of the measured
  steps run again on a one-rank rollout engine of the same settings on the same GPU, warmed up, median of
  ``--standalone-repeats`` passes (:mod:`megarl.bench.vllm_standalone`): ``status``, ``init_s``, ``tokens``,
  ``seconds``, ``tokens_per_s`` (median pass), ``tokens_per_s_runs``, ``spread`` ((max - min) / median),
  ``repeats``, ``rl_generate_call_tokens_per_s`` (the engine's own calls), ``rl_generate_phase_tokens_per_s_per_gpu``
  (the phase, its sleep included), ``ratio`` (RL call / standalone) and ``ratio_generate_phase``; null on the
  other ranks.

Units: seconds, tokens, FLOPs, bytes, percent for utilisation, fractions (0-1) for MFU.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.measure.flops import device_name, measured_bf16_flops, mfu, peak_bf16_flops
from megarl.measure.monitor import UtilizationSampler
from megarl.bench.vllm_standalone import GenerateRecorder
from megarl.config import Config, to_dict
from megarl.models.layout_lora import parameter_counts
from megarl.models.lora import LoRASpec
from megarl.output_folder import write_beside

PHASE_ORDER = ("wake_up", "reshard", "generate", "reward", "old_logprobs", "reference", "values", "advantages",
               "critic_update", "actor_update")


def bench_step(cfg: Config, *, steps: int, warmup: int, json_path: str | os.PathLike,
               peak_tflops: float | None = None, sample_interval_s: float = 0.1, standalone_vllm: bool = False,
               standalone_repeats: int = 3, config_path: str | None = None,
               overrides: list[str] | None = None) -> dict[str, Any]:
    """Run ``warmup + steps`` RL steps of ``cfg`` on this rank (call on every rank) and report the measured ones.

    Args:
        json_path: the report file (replaced when it exists: the caller checks that it may be).
        standalone_vllm: afterwards, generate rank 0's batches of the measured steps again on a plain vLLM
            (:mod:`megarl.bench.vllm_standalone`) and report the ratio (``standalone_vllm`` in the report).
        standalone_repeats: timed passes of that baseline (its median and spread are reported).

    Returns:
        The report (see the module docstring), on every rank; rank 0 prints the table and writes the JSON.

    Raises:
        Whatever the trainer raises (after rank 0 wrote a report with status "oom" or "error").
    """
    cfg.trainer.steps = warmup + steps  # the loader's epochs cover every step
    cfg.trainer.log_samples = 0
    cfg.trainer.resume = False
    path = Path(json_path)
    report: dict[str, Any] = {"status": "ok", "config": _config_section(cfg, config_path, overrides),
                              "world_size": cfg.world_size, "device": device_name(), "steps": steps,
                              "warmup": warmup}
    try:
        run = _measure(cfg, steps, warmup, sample_interval_s, record=standalone_vllm)  # the trainer is gone after
        peaks = {"datasheet": peak_tflops * 1e12 if peak_tflops else peak_bf16_flops(),
                 "measured": measured_bf16_flops()}
        report["world_size"] = run["world"]  # under torchrun with dp=0 the config alone does not know it
        report["parameters"] = parameter_counts(run["spec"], LoRASpec.from_config(cfg.actor.lora))
        layout = report["config"]["layout"]
        layout.update(world_size=run["world"], dp=run["world"] // (layout["tp"] * layout["pp"]))
        report.update(summarize(run["history"], run["world"], peaks))
        report["gpu_util"] = _gather_utilization(run["utilization"])
        report["peak_memory_bytes"] = max((p["peak_memory_bytes"] for p in report["phases"].values()), default=0)
        report["rollout"] = rollout_agreement(run["history"])
        report["overlap"] = overlap_figures(run["history"])
        report["machine"] = machine(run["world"])
        if standalone_vllm:
            report["standalone_vllm"] = _standalone_vllm(cfg, run, report, standalone_repeats)
    except Exception as e:
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        report.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {e}")
        _write(report, path)
        raise
    _write(report, path)
    if _rank() == 0:
        print(format_table(report), flush=True)
        print(f"bench step: report written to {path}", flush=True)
    return report


def _measure(cfg: Config, steps: int, warmup: int, sample_interval_s: float, *, record: bool) -> dict[str, Any]:
    """Build the trainer, run the steps, and return what the report needs (the trainer is dropped on return,
    so that its GPU memory can be given back)."""
    from megarl.trainer.builders import seed_all
    from megarl.trainer.trainer import Trainer

    seed_all(cfg.run.seed)  # as megarl train: every DP replica starts from the same random weights
    trainer = Trainer(cfg)
    recorder = None
    if trainer.split_rollout:
        return _measure_split(trainer, steps, warmup, sample_interval_s, record=record)
    if record:
        recorder = trainer.engine = GenerateRecorder(trainer.engine)
    batches = iter(trainer.loader)
    for _ in range(warmup):
        _one_step(trainer, batches)
    with UtilizationSampler(sample_interval_s) as sampler:
        if recorder is not None:
            recorder.recording = True
        history = [_one_step(trainer, batches) for _ in range(steps)]
    return {"history": history, "world": trainer.world, "utilization": sampler.samples.summary(),
            "spec": trainer.engine.spec, "recorded": recorder.recorded if recorder is not None else []}


def _measure_split(trainer, steps: int, warmup: int, sample_interval_s: float, *, record: bool
                   ) -> dict[str, Any]:
    """:func:`_measure` with the rollout on a pool of its own (``trainer.mode`` sync or async,
    :func:`~megarl.trainer.loop.fit_split`): the training ranks' metrics, shared with every rank."""
    from megarl.config import ConfigError
    from megarl.parallel.placement import share_object
    from megarl.trainer.loop import fit_split

    if record:
        raise ConfigError("--standalone-vllm regenerates rank 0's rollout calls, but with placement.rollout on a "
                          "pool of its own rank 0 generates nothing; leave it out or use placement.rollout=all")
    pipeline = fit_split(trainer, iter(trainer.loader), steps=warmup + steps)
    for _ in range(warmup):
        next(pipeline)
    with UtilizationSampler(sample_interval_s) as sampler:
        history = [metrics for _, metrics in pipeline]
    return {"history": share_object(history, [0]), "world": trainer.world, "utilization": sampler.samples.summary(),
            "spec": trainer.spec, "recorded": []}


def _one_step(trainer, batches) -> dict[str, Any]:
    metrics = trainer.step(next(batches), lambda: next(batches))  # more prompts: dynamic sampling
    trainer.state.step += 1
    return metrics


ROLLOUT_METRICS = {"rollout_vs_old_logprob_diff": "actor/rollout_vs_old_logprob_diff", "kl_k3": "rollout_corr/kl_k3",
                   "truncated_frac": "rollout_corr/truncated_frac",
                   **{k: f"mismatch/{k}" for k in ("token_mult_prob_error", "gen_kl_error", "abs_diff_max",
                                                   "abs_diff_p99", "exact_tokens_frac")}}


def rollout_agreement(history: list[dict[str, Any]]) -> dict[str, float]:
    """The report's ``rollout`` section: the mean of each of :data:`ROLLOUT_METRICS` over the measured steps
    that logged it (absent where none did)."""
    out = {}
    for name, key in ROLLOUT_METRICS.items():
        values = [float(h[key]) for h in history if key in h]
        if values:
            out[name] = sum(values) / len(values)
    return out


def overlap_figures(history: list[dict[str, Any]]) -> dict[str, float]:
    """The report's ``overlap`` section (``rollout.overlap_scoring``, :mod:`megarl.rollout.overlap`): the mean of
    each ``overlap/*`` metric over the measured steps, without its prefix (empty without the overlap)."""
    names = sorted({k for h in history for k in h if k.startswith("overlap/")})
    return {k.split("/", 1)[1]: sum(float(h[k]) for h in history) / len(history) for k in names}


def _standalone_vllm(cfg: Config, run: dict[str, Any], report: dict[str, Any], repeats: int) -> dict[str, Any] | None:
    """Rank 0 runs :mod:`megarl.bench.vllm_standalone` in a child process on its GPU on its recorded calls
    (the other ranks wait); returns the child's result with the RL rates and their ratios to it."""
    from megarl.rollout.vllm_engine import VLLMSettings, write_model_dir

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result = None
    if _rank() == 0:
        with tempfile.TemporaryDirectory(prefix="megarl-standalone-") as tmp:
            r = cfg.rollout
            write_model_dir(run["spec"], tmp, r.quantization)
            request = {"model_dir": tmp, "calls": run["recorded"], "repeats": repeats,
                       "engine": {"enforce_eager": r.enforce_eager, "gpu_memory_utilization": r.gpu_memory_utilization,
                                  "max_model_len": run["spec"].max_position_embeddings, "seed": cfg.run.seed,
                                  "settings": VLLMSettings.from_config(r).as_dict()}}
            Path(tmp, "request.json").write_text(json.dumps(request))
            free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
            proc = subprocess.run([sys.executable, "-m", "megarl.bench.vllm_standalone", f"{tmp}/request.json",
                                   f"{tmp}/result.json"], env=_child_env(), capture_output=True, text=True)
            out = Path(tmp, "result.json")
            result = json.loads(out.read_text()) if out.exists() else {
                "status": "error", "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
        result["free_memory_bytes_at_start"] = free
        tokens = sum(sum(c["lengths"]) for c in run["recorded"])
        seconds = sum(c["seconds"] for c in run["recorded"])
        result["rl_generate_call_tokens_per_s"] = tokens / seconds if seconds else None
        result["rl_generate_phase_tokens_per_s_per_gpu"] = report["phases"]["generate"]["tokens_per_s_per_gpu"]
        if result["status"] == "ok" and seconds:
            result["ratio"] = result["rl_generate_call_tokens_per_s"] / result["tokens_per_s"]
            result["ratio_generate_phase"] = result["rl_generate_phase_tokens_per_s_per_gpu"] / result["tokens_per_s"]
    if dist.is_initialized():
        dist.barrier()
    return result


def machine(world: int) -> dict[str, Any]:
    """The report's ``machine`` section (module docstring) for ``world`` GPUs (ranks)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm = version("vllm")
    except PackageNotFoundError:
        vllm = None
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                         text=True) if shutil.which("git") else None
    return {"gpu": device_name(), "gpus": world, "host": platform.node(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "vllm": vllm,
            "commit": git.stdout.strip() if git is not None and git.returncode == 0 else None}


def _child_env() -> dict[str, str]:
    """This process's environment for a one-GPU child: without torchrun's rank variables, with only this
    rank's GPU visible."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK")}
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[device] if visible else str(device)
    return env


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write(report: dict[str, Any], path: Path) -> None:
    if _rank() != 0:
        return
    write_beside(path, lambda tmp: tmp.write_text(json.dumps(report, indent=2, default=str)), "bench step")


def _config_section(cfg: Config, config_path: str | None, overrides: list[str] | None) -> dict[str, Any]:
    p = cfg.actor.parallel
    world = cfg.world_size
    layout = {"tp": p.tp, "pp": p.pp, "dp": world // p.replica_size, "cp": p.cp, "vpp": p.vpp, "world_size": world,
              "sequence_parallel": p.sequence_parallel, "rollout_engine": cfg.rollout.engine,
              "rollout_tp": cfg.rollout.tp, "model": cfg.model.path, "dtype": cfg.model.dtype,
              "prompts_per_step": cfg.data.prompts_per_step, "n": cfg.rollout.n,
              "max_new_tokens": cfg.rollout.max_new_tokens, "micro_batch_size": cfg.actor.micro_batch_size,
              "logprob_micro_batch_size": cfg.actor.logprob_micro_batch_size,
              "ppo_mini_batch_size": cfg.actor.ppo_mini_batch_size, "mode": cfg.trainer.mode,
              "max_staleness": cfg.trainer.max_staleness if cfg.trainer.mode == "async" else 0,
              "rollout_pool": cfg.placement.pools[cfg.placement.rollout]}
    return {"path": config_path, "overrides": list(overrides or []), "layout": layout, "resolved": to_dict(cfg)}


def summarize(history: list[dict[str, Any]], world: int, peaks: dict[str, float | None]) -> dict[str, Any]:
    """The report's throughput sections from the trainer's per-step metrics of the measured steps.

    Args:
        history: :meth:`~megarl.trainer.trainer.Trainer.step`'s metrics of each measured step (``time/*``,
            ``perf/*``, ``memory/*``; the memory peaks of this rank).
        world: GPUs (ranks).
        peaks: ``{"datasheet": FLOP/s or None, "measured": FLOP/s or None}`` per GPU.

    Returns:
        ``step_time_s``, ``tokens_per_s``, ``tokens_per_s_per_gpu``, ``generate_tokens_per_s``, ``mfu``,
        ``mfu_vs_measured``, ``peak_tflops``, ``phases`` and ``per_step`` (see the module docstring); memory
        peaks are the maximum over ranks when torch.distributed is initialised.
    """
    n = len(history)
    seen = {k.removeprefix("time/") for h in history for k in h if k.startswith("time/") and k != "time/step"}
    names = [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))
    peak_mem = _max_over_ranks({p: max(int(h.get(f"memory/{p}/peak_bytes", 0)) for h in history) for p in names})

    def total(key: str) -> float:
        return float(sum(h.get(key, 0.0) for h in history))

    phases, all_flops = {}, 0.0
    for p in names:
        secs, tokens, flops = total(f"time/{p}"), total(f"perf/{p}/tokens"), total(f"perf/{p}/flops")
        has_tokens = any(f"perf/{p}/tokens" in h for h in history)
        all_flops += flops
        phases[p] = {
            "time_s": secs / n,
            "tokens": tokens / n if has_tokens else None,
            "tokens_per_s": tokens / secs if has_tokens and secs > 0 else None,
            "tokens_per_s_per_gpu": tokens / secs / world if has_tokens and secs > 0 else None,
            "flops": flops / n if flops else None,
            "mfu": mfu(flops, secs, world, peaks["datasheet"]) if flops else None,
            "mfu_vs_measured": mfu(flops, secs, world, peaks["measured"]) if flops else None,
            "peak_memory_bytes": peak_mem[p],
        }
    step_s = total("time/step")
    tokens = total("perf/tokens")
    pools = sorted({k.split("/")[1] for h in history for k in h if k.startswith("pool/")})
    gen = phases.get("generate", {})
    return {
        "step_time_s": step_s / n,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / world,
        "generate_tokens_per_s": gen.get("tokens_per_s"),
        "mfu": mfu(all_flops, step_s, world, peaks["datasheet"]),
        "mfu_vs_measured": mfu(all_flops, step_s, world, peaks["measured"]),
        "peak_tflops": {k: v / 1e12 if v else None for k, v in peaks.items()},
        "phases": phases,
        "pools": {p: {"busy_s": total(f"pool/{p}/busy_s") / n, "idle_s": total(f"pool/{p}/idle_s") / n}
                  for p in pools},
        "per_step": [{"step_time_s": h["time/step"], **{p: h.get(f"time/{p}") for p in names}} for h in history],
    }


def _max_over_ranks(values: dict[str, int]) -> dict[str, int]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    parts: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(parts, values)
    return {k: max(p.get(k, 0) for p in parts) for k in values}


def _gather_utilization(local: dict[str, Any]) -> dict[str, Any]:
    parts = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    utils = [p["util_mean_pct"] for p in parts if p["util_mean_pct"] is not None]
    mems = [p["memory_max_bytes"] for p in parts if p["memory_max_bytes"] is not None]
    return {"source": local["source"], "util_mean_pct": sum(utils) / len(utils) if utils else None,
            "util_max_pct": max((p["util_max_pct"] for p in parts if p["util_max_pct"] is not None), default=None),
            "memory_max_bytes": max(mems) if mems else None, "per_rank": parts}


def format_table(report: dict[str, Any]) -> str:
    """The report as a console table: one row per phase, then the step."""
    def num(v, fmt):
        return "-" if v is None else fmt.format(v)

    rows = [("phase", "s/step", "tokens/step", "tokens/s", "tokens/s/GPU", "MFU", "MFU(meas.)", "peak GiB")]
    for name, p in report["phases"].items():
        rows.append((name, num(p["time_s"], "{:.3f}"), num(p["tokens"], "{:,.0f}"), num(p["tokens_per_s"], "{:,.0f}"),
                     num(p["tokens_per_s_per_gpu"], "{:,.0f}"), num(p["mfu"], "{:.1%}"),
                     num(p["mfu_vs_measured"], "{:.1%}"), num(p["peak_memory_bytes"] / 2**30, "{:.2f}")))
    rows.append(("step", num(report["step_time_s"], "{:.3f}"), "", num(report["tokens_per_s"], "{:,.0f}"),
                 num(report["tokens_per_s_per_gpu"], "{:,.0f}"), num(report["mfu"], "{:.1%}"),
                 num(report["mfu_vs_measured"], "{:.1%}"), num(report["peak_memory_bytes"] / 2**30, "{:.2f}")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    counts = report.get("parameters")
    if counts:
        lines.append(f"parameters: {counts['trainable']:,} trainable of {counts['model'] + counts['adapters']:,}")
    pools = report.get("pools") or {}
    if pools:
        lines.append("pools (s/step): " + "; ".join(f"{name} busy {p['busy_s']:.3f} idle {p['idle_s']:.3f}"
                                                    for name, p in pools.items()))
    u = report.get("gpu_util") or {}
    peak = report["peak_tflops"]
    lines.append(f"{report['device']} x {report['world_size']}, {report['steps']} measured steps after "
                 f"{report['warmup']} warm-up; MFU vs {num(peak['datasheet'], '{:g}')} TFLOP/s (datasheet), "
                 f"{num(peak['measured'], '{:g}')} (measured); utilisation ({u.get('source')}) mean "
                 f"{num(u.get('util_mean_pct'), '{:.0f}')}%, max memory "
                 f"{num((u.get('memory_max_bytes') or 0) / 2**30, '{:.2f}')} GiB")
    return "\n".join(lines)
