"""Per-step metrics: what a step measures (:func:`batch_metrics`, :func:`update_metrics`, :func:`timing_metrics`),
a JSONL file, a progress bar with a one-line digest per step, TensorBoard and W&B, and the end-of-run summary.

Step 0 holds the validation before the first step (its record has only ``val/`` metrics); validation after
step ``k`` is part of step ``k``'s record.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megarl.jsonl import append_records, latest_per_step, one_record, read_records
from megarl.trainer.pipeline import staleness

# (metric key, label, format) of the one-line digest printed after every step
DIGEST = [
    ("reward/mean", "reward", "{:.3f}"), ("reward/std", "±", "{:.3f}"), ("reward/accuracy", "acc", "{:.2f}"),
    ("response/length_mean", "len", "{:.0f}"), ("actor/kl", "kl", "{:.4f}"), ("actor/entropy", "ent", "{:.3f}"),
    ("actor/clipfrac", "clip", "{:.3f}"), ("actor/pg_loss", "pg", "{:+.4f}"), ("critic/vf_loss", "vf", "{:.4f}"),
    ("sft/loss", "loss", "{:.4f}"), ("sft/tokens_per_s", "tok/s", "{:.0f}"), ("dpo/loss", "dpo loss", "{:.4f}"),
    ("dpo/margin", "margin", "{:+.3f}"),
    ("dpo/accuracy", "pref acc", "{:.2f}"), ("actor/grad_norm", "gnorm", "{:.3f}"), ("actor/lr", "lr", "{:.2e}"),
    ("throughput/generate_tokens_per_s", "gen tok/s", "{:.0f}"), ("perf/tokens_per_s_per_gpu", "tok/s/GPU", "{:.0f}"),
    ("perf/mfu", "MFU", "{:.1%}"), ("time/step", "step s", "{:.1f}"),
    ("rollout/staleness", "stale", "{:.0f}"),
    ("val/accuracy", "val acc", "{:.3f}"), ("val/reward_mean", "val reward", "{:.3f}"),
    ("val/seconds", "val s", "{:.1f}"), ("val/loss", "val loss", "{:.4f}"),
]
# the progress bar of each kind of run: its name and the (metric key, label, format) shown beside it
PROGRESS = {
    "rl": ("RL steps", [("reward/mean", "reward", "{:.3f}")]),
    "sft": ("SFT steps", [("sft/loss", "loss", "{:.4f}"), ("sft/tokens_per_s", "tok/s", "{:.0f}"),
                          ("actor/lr", "lr", "{:.2e}")]),
    "dpo": ("DPO steps", [("dpo/loss", "loss", "{:.4f}"), ("dpo/accuracy", "pref acc", "{:.2f}"),
                          ("actor/lr", "lr", "{:.2e}")]),
}


def digest(step: int, total: int, m: dict[str, Any]) -> str:
    """``step 3/4 | reward 0.125 ± 0.331 | ...`` from the metrics present."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in DIGEST:
        if key in m and m[key] is not None and not (isinstance(m[key], float) and math.isnan(m[key])):
            parts.append(f"{label} {fmt.format(m[key])}")
    pools = [p for p in ("train", "rollout") if f"pool/{p}/busy_s" in m]
    if pools:  # each pool's busy/idle seconds: the overlap of a rollout pool of its own
        parts.append("busy/idle " + " ".join(f"{p} {m[f'pool/{p}/busy_s']:.1f}/{m[f'pool/{p}/idle_s']:.1f}s"
                                             for p in pools))
    phases = [f"{k.removeprefix('time/')} {v:.1f}s" for k, v in m.items()
              if k.startswith("time/") and k != "time/step"]
    return " | ".join(parts) + ("  [" + ", ".join(phases) + "]" if phases else "")


class TensorBoardWriter:
    """Scalars as TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard``; needs ``tensorboard``); a
    run resumed after step ``start_step`` hides the events of later steps that an earlier attempt wrote
    (TensorBoard's ``purge_step``), so each step shows once."""

    def __init__(self, log_dir: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A W&B run in offline mode in ``<dir>/wandb`` (sync it later with ``wandb sync``).

    Raises:
        ImportError: wandb is not installed (``pip install 'megarl[wandb]'``).
    """

    def __init__(self, directory: Path, name: str, config: dict[str, Any] | None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("trainer.loggers has wandb, which is not installed: pip install 'megarl[wandb]'") from e
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="megarl", name=name, dir=str(directory), mode="offline", config=config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def batch_metrics(batch, *, version: int, step: int, epoch: int) -> dict[str, float]:
    """The step's batch (:class:`~megarl.data.batch.RolloutBatch`, scored and shared): reward mean, deviation
    (0 when tied) and accuracy over the scored samples (not ``dropped``), response and prompt lengths (tokens),
    the share of responses cut at ``rollout.max_new_tokens``, the policy ``version`` that generated it and its
    staleness at (1-based) ``step``, and the data ``epoch``."""
    import torch  # here: the report and the summary read this module without torch

    from megarl.algos.aggregation import masked_mean, masked_var

    mask = batch["response_mask"]
    scores, scored = batch["scores"], ~batch["dropped"]
    return {
        "reward/mean": masked_mean(scores, scored).item(),
        "reward/std": masked_var(scores[None], scored[None]).sqrt().item(),
        "reward/accuracy": masked_mean(torch.tensor(batch.meta["correct"]).float(), scored).item(),
        "response/length_mean": mask.sum(-1).mean().item(), "response/length_max": mask.sum(-1).max().item(),
        "response/clip_ratio": float(np.mean([r == "length" for r in batch.meta["finish_reason"]])),
        "prompt/length_mean": batch["prompt_lens"].float().mean().item(),
        "rollout/policy_version": version, "rollout/staleness": staleness(step, version), "data/epoch": epoch,
    }


def update_metrics(role: str, history: list[dict[str, float]]) -> dict[str, float]:
    """A role's updates in a step (one metrics dict per optimizer step, :meth:`~megarl.workers.engine.
    MegatronWorker.train_minibatches`): the mean of each metric, keyed ``role/name``; for the actor also its first
    mini-batch's ``ppo_kl`` and ``log_ratio_absmax`` (first-step exactness: with one mini-batch and one epoch both
    are exactly 0, slime's CI check)."""
    keys = history[0].keys() if history else []
    metrics = {f"{role}/{k}": float(np.mean([h[k] for h in history])) for k in keys}
    if role == "actor":
        metrics["actor/ppo_kl_first_minibatch"] = history[0]["ppo_kl"]
        metrics["actor/log_ratio_absmax_first_minibatch"] = history[0]["log_ratio_absmax"]
    return metrics


def timing_metrics(phases: dict[str, float], offload_s: dict[str, float], reshard_stats, busy: dict[str, float],
                   step_s: float, generated_tokens: int) -> dict[str, float]:
    """The step's seconds per phase (``phases``), host offload moves (``offload_s``), reshard figures (the
    executor's stats, or None where this rank did not reshard), each pool's busy and idle seconds (``busy``:
    idle = the step's seconds less the pool's busy ones and the reshard's; colocated, each pool idles while the
    other works) and the generation's tokens per second."""
    reshard_s = phases.get("reshard", 0.0)
    return {
        "offload/to_host_s": offload_s["to_host"], "offload/to_device_s": offload_s["to_device"],
        "reshard/bytes_sent": getattr(reshard_stats, "bytes_sent", 0),
        "reshard/peak_extra_bytes": getattr(reshard_stats, "peak_extra_bytes", 0),
        "reshard/bytes_staged": getattr(reshard_stats, "bytes_staged", 0),
        "reshard/merge_s": getattr(reshard_stats, "times_s", {}).get("merge", 0.0),
        **{f"time/{k}": v for k, v in phases.items()}, "time/step": step_s,
        **{f"pool/{p}/busy_s": b for p, b in busy.items()},
        **{f"pool/{p}/idle_s": max(0.0, step_s - b - reshard_s) for p, b in busy.items()},
        "throughput/generate_tokens_per_s": generated_tokens / max(phases["generate"], 1e-9),
    }


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among ``metrics`` (what TensorBoard and W&B plot)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class MetricsLogger:
    """Appends one JSON object per step to ``path``, shows progress and feeds the other ``loggers``; active on
    one rank only.

    Args:
        path: the JSONL file (appended to, so a resumed run continues it, after a torn last line left by a crash
            is set aside: :func:`megarl.jsonl.append_records`; a run at step 0 finds none there, an earlier run's
            moved aside: :mod:`megarl.trainer.run_record`); TensorBoard and W&B write beside it, in
            ``tensorboard/`` and ``wandb/``.
        total_steps / start_step: for the progress bar.
        enabled: False on every rank but the one that reports.
        progress: show a tqdm bar (with "console").
        kind: the run's kind, a key of :data:`PROGRESS` ("rl", "sft", "dpo"): the bar's name and figures.
        loggers: names of ``trainer.loggers`` (console, jsonl, tensorboard, wandb).
        config: the run's config, for W&B.
    """

    def __init__(self, path: Path, total_steps: int, start_step: int, *, enabled: bool, progress: bool = True,
                 loggers: Sequence[str] = ("console", "jsonl"), config: dict[str, Any] | None = None,
                 kind: str = "rl"):
        self.path, self.total, self.enabled = Path(path), total_steps, enabled
        desc, self.postfix = PROGRESS[kind]
        self.console = "console" in loggers
        self.bar = None
        self.writers: list[TensorBoardWriter | WandbWriter] = []
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if "tensorboard" in loggers:
                self.writers.append(TensorBoardWriter(self.path.parent / "tensorboard", start_step))
            if "wandb" in loggers:
                self.writers.append(WandbWriter(self.path.parent, self.path.parent.name, config))
            if progress and self.console:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                                dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_records(self.path, [{"step": step, **metrics}])
        for writer in self.writers:
            writer.log(step, metrics)
        if not self.console:
            return
        line = digest(step, self.total, metrics)
        if self.bar is not None:
            self.bar.write(line)
            if step > self.bar.n:
                self.bar.update(step - self.bar.n)
                self.bar.set_postfix({label: fmt.format(metrics[key]) for key, label, fmt in self.postfix
                                      if metrics.get(key) is not None})
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for writer in self.writers:
            writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All step records of a metrics JSONL file, one a step, by step (a step logged again, by a run resumed before
    it that an older megarl did not cut back, counts as the later record, the records logged after it before
    that resume dropped: :func:`megarl.jsonl.latest_per_step`; a torn or damaged line is skipped with a
    warning: :func:`megarl.jsonl.read_records`)."""
    records = [rec for rec in read_records(path) if isinstance(rec.get("step"), int)]
    return sorted((records[i] for i in latest_per_step(records, one_record)), key=lambda rec: rec["step"])


def summary_text(history: list[dict[str, Any]], *, run_dir: Path, checkpoint: Path | None,
                 hf_export: Path | None, wall_s: float, steps_this_session: int,
                 validation: str | None = None, notes: Sequence[str] = ()) -> str:
    """A human-readable end-of-run summary: reward and accuracy by step, validation accuracy by step (with
    ``validation`` describing its prompts) or, for an offline run (``megarl sft``, ``megarl dpo``), its losses and
    validation loss by step, throughput, where things were written, and ``notes`` (lines on
    how the run was resumed and restarted)."""
    validated = [h for h in history if h.get("val/accuracy") is not None]
    val_loss = [h for h in history if h.get("val/loss") is not None]
    history = [h for h in history if h["step"] > 0]  # step 0: the validation before training
    if not history:
        return f"no steps were run; run folder {run_dir}"
    last = history[-1]

    def by_step(key: str, fmt: str = "{:.3f}") -> str:
        values = [h[key] for h in history if h.get(key) is not None]
        if not values:
            return "n/a"
        shown = values if len(values) <= 12 else values[:6] + ["..."] + values[-5:]
        text = " ".join(v if isinstance(v, str) else fmt.format(v) for v in shown)
        return f"{text}   (mean {sum(values) / len(values):.3f})"

    def fmt(key, f="{:.3f}"):
        v = last.get(key)
        return "n/a" if v is None else f.format(v)

    def mean(key, f):
        values = [h[key] for h in history if h.get(key) is not None]
        return f.format(sum(values) / len(values)) if values else "n/a"

    gen = [h["throughput/generate_tokens_per_s"] for h in history if h.get("throughput/generate_tokens_per_s")]
    losses = [k for k in ("sft/loss", "dpo/loss", "dpo/margin") if any(k in h for h in history)]
    lines = [
        "=" * 72,
        f"megarl run finished at step {last['step']} ({steps_this_session} step{'' if steps_this_session == 1 else 's'}"
        f" in this session, {wall_s:.0f} s)",
    ]
    if losses:  # an offline run (megarl sft, megarl dpo): no rewards, no generation
        lines += [f"  {k + ' by step':<19}{by_step(k, '{:.4f}')}" for k in losses]
        lines += [f"  val loss           " + "  ".join(f"step {h['step']}: {h['val/loss']:.4f}" for h in val_loss)
                  + f"   ({validation})"] if val_loss else []
    else:
        lines += [
            f"  reward by step     {by_step('reward/mean')}",
            f"  accuracy by step   {by_step('reward/accuracy', '{:.2f}')}",
            *([f"  val accuracy       " + "  ".join(f"step {h['step']}: {h['val/accuracy']:.3f}" for h in validated)
               + f"   ({validation})"] if validated else []),
            f"  last step          response length {fmt('response/length_mean', '{:.0f}')} tokens "
            f"({fmt('response/clip_ratio', '{:.0%}')} cut at rollout.max_new_tokens), KL to ref "
            f"{fmt('actor/kl', '{:.5f}')}, entropy {fmt('actor/entropy')}",
            f"  generation         {sum(gen) / len(gen):.1f} tokens/s on average" if gen else "  generation    n/a",
        ]
        if any("distill/reverse_kl" in h for h in history):  # on-policy distillation: KL to the teacher, not a ref
            lines.append(f"  reverse KL to the teacher by step {by_step('distill/reverse_kl', '{:.5f}')}")
    samples = run_dir / "samples.jsonl"  # an RL run's; megarl sft and dpo write none
    throughput = ([f"  throughput         {mean('perf/tokens_per_s_per_gpu', '{:.0f}')} tokens/s/GPU (prompt + "
                   f"response), MFU {mean('perf/mfu', '{:.1%}')} on average"] if not losses else
                  [f"  throughput         {mean('sft/tokens_per_s', '{:.0f}')} tokens/s (sft/tokens_per_s) on average"]
                  if any("sft/tokens_per_s" in h for h in history) else [])  # (dpo: none)
    lines += [
        f"  step time          {sum(h.get('time/step', 0) for h in history) / len(history):.1f} s on average",
        *throughput,
        f"  metrics            {run_dir / 'metrics.jsonl'}" + (f" (samples: {samples})" if samples.exists() else ""),
        f"  checkpoint         {checkpoint if checkpoint else 'none written'}",
    ]
    if hf_export:
        lines.append(f"  HF export          {hf_export}")
    lines += [f"  {note}" for note in notes]
    lines.append("=" * 72)
    return "\n".join(lines)
