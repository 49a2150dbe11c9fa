"""``megarl report RUN_DIR``: plots of a run and a markdown page with them, its config and a few samples.

Reads what a run folder holds (``metrics.jsonl``, ``config.json``, ``samples.jsonl``, ``val_samples.jsonl``)
and writes, beside them, ``report.md`` and its figures in ``report/`` (PNG, matplotlib):

- ``reward.png``: training reward and accuracy by step, validation accuracy by step (step 0: before training);
- ``time.png``: seconds per phase of each step (the ``time/*`` metrics) as stacked bars;
- ``length.png``: mean response length (tokens) and the share of responses cut at ``max_new_tokens``;
- ``kl_entropy.png``: KL to the reference policy and the policy's entropy by step (when logged);
- ``loss.png`` instead of ``reward.png`` and ``length.png`` for an offline run (``megarl sft``, ``megarl dpo``):
  its training and validation losses (and DPO's margin) by step.

The page lists the best, the worst and cut-off responses among the logged training and validation samples.
``megarl train`` writes the report at the end of a run (``trainer.report``); ``megarl report`` replaces an
existing report (the run's, an earlier ``megarl report``'s) only with ``--overwrite``, the page and the figures'
folder each written beside and renamed into place (:mod:`megarl.output_folder`). Needs matplotlib
(``pip install 'megarl[report]'``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # ImportError without matplotlib: the trainer then skips the report
from matplotlib.ticker import MaxNLocator

from megarl.jsonl import latest_per_step, read_records
from megarl.output_folder import claim_outputs, write_beside
from megarl.trainer.metrics import read_metrics

SAMPLES_SHOWN = 2  # of each kind: best, worst, cut off
TEXT_CHARS = 600  # longer prompts and responses are shortened on the page


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(h["step"], h[key]) for h in history if isinstance(h.get(key), (int, float))]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _figure(path: Path, title: str, draw) -> Path:
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    draw(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return path


def plot_run(history: list[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    """Write the figures of the module docstring into ``out_dir``; returns name -> PNG path (a figure
    whose metrics were never logged is left out)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train = [h for h in history if h["step"] > 0]
    figures: dict[str, Path] = {}

    def reward(ax):
        for key, label, style in (("reward/mean", "train reward", "-o"), ("reward/accuracy", "train accuracy", "--o"),
                                  ("val/accuracy", "validation accuracy", "-s")):
            x, y = _series(history, key)
            if x:
                ax.plot(x, y, style, label=label, markersize=4)
        ax.set_ylabel("reward / accuracy")
        ax.legend(loc="best", fontsize="small")

    losses = [k for k in ("sft/loss", "dpo/loss", "val/loss", "dpo/margin") if any(k in h for h in history)]
    if losses:  # an offline run (megarl sft, megarl dpo): its losses instead of rewards and responses
        def loss(ax):
            for key in losses:
                x, y = _series(history, key)
                ax.plot(x, y, "-s" if key.startswith("val/") else "-o", label=key, markersize=4)
            ax.set_ylabel("loss (nats) / margin")
            ax.legend(loc="best", fontsize="small")

        figures["loss"] = _figure(out_dir / "loss.png", "Loss", loss)
    else:
        figures["reward"] = _figure(out_dir / "reward.png", "Reward and accuracy", reward)

    phases = sorted({k for h in train for k in h if k.startswith("time/") and k != "time/step"})
    if phases:
        def times(ax):
            steps = [h["step"] for h in train]
            bottom = [0.0] * len(train)
            for key in phases:
                values = [float(h.get(key, 0.0)) for h in train]
                ax.bar(steps, values, bottom=bottom, label=key.removeprefix("time/"))
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_ylabel("seconds")
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

        figures["time"] = _figure(out_dir / "time.png", "Time per phase", times)

    def length(ax):
        for key, label in (("response/length_mean", "train"), ("val/response_length_mean", "validation")):
            x, y = _series(history, key)
            if x:
                ax.plot(x, y, "-o", label=f"length, {label}", markersize=4)
        ax.set_ylabel("response length (tokens)")
        right = ax.twinx()
        for key, label in (("response/clip_ratio", "train"), ("val/clip_ratio", "validation")):
            x, y = _series(history, key)
            if x:
                right.plot(x, y, ":x", label=f"cut at max_new_tokens, {label}")
        right.set_ylabel("share cut at max_new_tokens")
        right.set_ylim(-0.05, 1.05)
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="best", fontsize="small")

    if not losses:
        figures["length"] = _figure(out_dir / "length.png", "Response length and clipping", length)

    if any("actor/kl" in h or "actor/entropy" in h for h in train):
        def kl_entropy(ax):
            x, y = _series(train, "actor/entropy")
            if x:
                ax.plot(x, y, "-o", color="tab:blue", label="entropy", markersize=4)
            ax.set_ylabel("entropy (nats/token)")
            right = ax.twinx()
            x, y = _series(train, "actor/kl")
            if x:
                right.plot(x, y, "-s", color="tab:red", label="KL to reference", markersize=4)
            right.set_ylabel("KL")
            lines, more = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
            ax.legend(lines[0] + more[0], lines[1] + more[1], loc="best", fontsize="small")

        figures["kl_entropy"] = _figure(out_dir / "kl_entropy.png", "KL and entropy", kl_entropy)
    return figures


def _read_jsonl(path: Path, **tag: Any) -> list[dict[str, Any]]:
    """The samples of a run's samples file, each step's once (:func:`megarl.jsonl.latest_per_step`), with ``tag``."""
    records = read_records(path)
    return [{**records[i], **tag} for i in latest_per_step(records)]


def pick_samples(samples: list[dict[str, Any]], k: int = SAMPLES_SHOWN) -> dict[str, list[dict[str, Any]]]:
    """The ``k`` best (highest score, latest step first), ``k`` worst and ``k`` cut-off (``finish_reason``
    "length", latest first) samples; each sample appears once on the page (identical (prompt, response) pairs
    count once, and a sample already shown under an earlier kind is not shown again: a cut-off response is
    often among the worst too)."""
    unique = {(s.get("prompt"), s.get("response")): s for s in samples}  # one of identical samples (n per prompt)
    samples = list(unique.values())
    orders = {"Best": sorted(samples, key=lambda s: (-s.get("score", 0.0), -s.get("step", 0))),
              "Worst": sorted(samples, key=lambda s: (s.get("score", 0.0), -s.get("step", 0))),
              "Cut at max_new_tokens": sorted((s for s in samples if s.get("finish_reason") == "length"),
                                              key=lambda s: -s.get("step", 0))}
    shown: set[int] = set()
    picked = {}
    for kind, order in orders.items():
        picked[kind] = [s for s in order if id(s) not in shown][:k]
        shown |= {id(s) for s in picked[kind]}
    return picked


def _quote(text: Any) -> str:
    text = str(text)
    if len(text) > TEXT_CHARS:
        text = text[:TEXT_CHARS] + " [...]"
    return "\n".join("    " + line for line in text.splitlines() or [""])


def write_report(run_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``report.md`` and ``report/*.png`` for a run folder; returns the page's path.

    Args:
        overwrite: replace a report that exists (the run's own at its end passes True).

    Raises:
        OutputFolderError: without ``overwrite``, ``report.md`` or ``report/`` exists (nothing is read or written).
        FileNotFoundError: the folder has no ``metrics.jsonl`` (not a megarl run, or no step finished).
        ImportError: matplotlib is not installed.
    """
    import yaml

    run_dir = Path(run_dir)
    page, folder = claim_outputs([run_dir / "report.md", run_dir / "report"], "report", overwrite=overwrite)
    history = read_metrics(run_dir / "metrics.jsonl")
    if not history:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} is missing or empty: RUN_DIR must be a megarl run "
                                "folder (runs/<name>) with at least one finished step or validation")
    figures: dict[str, Path] = {}
    write_beside(folder, lambda tmp: figures.update(plot_run(history, tmp)), "report")
    train = [h for h in history if h["step"] > 0]
    val = [h for h in history if "val/accuracy" in h]
    lines = [f"# megarl run `{run_dir.name}`", ""]
    if train:
        last = train[-1]
        lines += [f"{last['step']} step{'' if last['step'] == 1 else 's'}; last step: reward {last.get('reward/mean', float('nan')):.3f}, "
                  f"accuracy {last.get('reward/accuracy', float('nan')):.3f}, response length "
                  f"{last.get('response/length_mean', float('nan')):.0f} tokens.", ""]
    if val:
        lines += ["| step | validation accuracy | mean reward | response length | cut at max_new_tokens |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {h['step']} | {h['val/accuracy']:.3f} | {h.get('val/reward_mean', float('nan')):.3f} | "
                  f"{h.get('val/response_length_mean', float('nan')):.0f} | {h.get('val/clip_ratio', float('nan')):.0%} |"
                  for h in val]
        lines.append("")
    for name, path in figures.items():
        lines += [f"![{name}]({folder.name}/{path.name})", ""]
    samples = (_read_jsonl(run_dir / "samples.jsonl", split="train")
               + _read_jsonl(run_dir / "val_samples.jsonl", split="validation"))
    if samples:
        lines += ["## Samples", ""]
        for kind, chosen in pick_samples(samples).items():
            for s in chosen:
                lines += [f"### {kind}: {s['split']}, step {s.get('step', '?')}, score {s.get('score', 0):.2f}, "
                          f"{s.get('length', '?')} tokens, {s.get('finish_reason', '?')}", "",
                          f"Ground truth: `{s.get('ground_truth')}`", "", "Prompt:", "", _quote(s.get("prompt", "")),
                          "", "Response:", "", _quote(s.get("response", "")), ""]
    config = run_dir / "config.json"
    if config.is_file():
        lines += ["## Config", "", "```yaml", yaml.safe_dump(json.loads(config.read_text()), sort_keys=False).rstrip(),
                  "```", ""]
    return write_beside(page, lambda tmp: tmp.write_text("\n".join(lines)), "report")
