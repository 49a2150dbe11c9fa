"""``megarl sweep SWEEP.yaml (--slurm | --local | --plan)``: a base config over a grid of config values, one
``megarl bench step`` per point, then a table, a CSV and a plot of throughput per layout.

A sweep file (``parallel_configs/sweeps/``)::

    name: cpu-tiny                     # results go to <output>/<name>/ (output default: runs/sweeps)
    base: null                         # a config YAML, or null (the defaults)
    overrides: [model.path=..., ...]   # applied to every point
    grid:                              # config key -> values; the points are the product
      actor.parallel.tp: [1, 2, 4]
      actor.parallel.pp: [1, 2]
    points: []                         # extra points, each a {key: value} mapping (hand-picked layouts)
    job: {nodes: 1, gpus_per_node: 0, ntasks_per_node: 2}   # every point runs on this job shape
    device_memory_gib: null            # per rank; null: the local GPU's, or host memory / ranks per node
    bench: {steps: 2, warmup: 1}

Before anything starts, every point is checked and the ones that cannot run are dropped, each with its
reason: a bad value (the config's own validation), TP/PP that does not divide the model's heads, KV heads or
layers (PP x VPP with ``actor.parallel.vpp`` in the grid), a mesh that does not match the job's world, batch
sizes that the DP size does not divide (or, with VPP, micro-batch counts that are not a multiple of PP), a vLLM
engine whose weights (``1 / rollout.tp`` of the model) overflow its reservation, and an estimated per-rank memory
(:mod:`megarl.launch.memory`) above the device's. Points whose result file exists
are skipped (``--retry-failed`` re-runs the failed ones). The rest run as one SLURM job array (``--slurm``;
the command waits for it) or one after another on this machine (``--local``). Each point's ``megarl bench
step`` writes ``results/<point>.json``; a point that ends without one (an error, OOM, the time limit) is
recorded there as failed with the reason, and the sweep goes on. At the end: ``results.csv``, ``results.md``
(the table sorted by tokens/s, then the dropped points with their reasons), ``throughput.png`` and
``sweep.json`` (the points), each written beside and renamed into place. A sweep that wrote them (or its job
script ``sweep.sbatch``) before is run again only with ``--overwrite`` (checked before anything runs); the
results of its points are kept either way, and a point's log is appended to.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megarl.config import Config, ConfigError, load_config
from megarl.launch.memory import GIB, MemoryEstimate, check_rollout_weights, estimate_memory, host_memory_bytes
from megarl.launch.submit import (JobShape, SbatchOptions, add_sbatch_arguments, batch_script, check_job_shape,
                                  sbatch, sbatch_options_from_args, srun_prefix)
from megarl.output_folder import claim_outputs, write_beside

SUMMARY = ("results.csv", "results.md", "throughput.png", "sweep.json")  # what every run writes at its end
SCRIPT = "sweep.sbatch"  # what --slurm writes before it submits


@dataclass
class SweepJob:
    """The job shape of every point (see :class:`megarl.launch.submit.JobShape`)."""

    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: Optional[int] = None


@dataclass
class BenchSettings:
    """``megarl bench step``'s measured and warm-up steps per point."""

    steps: int = 2
    warmup: int = 1


@dataclass
class SweepSpec:
    """A sweep file (see the module docstring)."""

    name: str = "sweep"
    output: str = "runs/sweeps"
    base: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    job: SweepJob = field(default_factory=SweepJob)
    device_memory_gib: Optional[float] = None
    bench: BenchSettings = field(default_factory=BenchSettings)

    @property
    def out_dir(self) -> Path:
        return Path(self.output) / self.name


@dataclass
class Point:
    """One point of the sweep: its name, its overrides (on top of the sweep's), and what became of it."""

    name: str
    values: dict[str, Any]
    overrides: list[str]
    reason: str | None = None           # why it was dropped before running
    estimate: MemoryEstimate | None = None


def load_sweep(path: str | os.PathLike) -> SweepSpec:
    """Read and type-check a sweep file.

    Raises:
        ConfigError: an unknown key or a wrong type, naming it; an empty grid.
        FileNotFoundError: no such file.
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not Path(path).is_file():
        raise FileNotFoundError(f"sweep file {path} does not exist (see parallel_configs/sweeps/)")
    try:
        spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SweepSpec), OmegaConf.load(path)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {getattr(e, 'full_key', None) or 'sweep'}: {str(e).splitlines()[0]}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not spec.grid and not spec.points:
        raise ConfigError(f"{path}: grid: list at least one config key with its values (or points)")
    for key, values in spec.grid.items():
        if not values:
            raise ConfigError(f"{path}: grid.{key}: give at least one value")
    for where, key in [*((f"grid.{k}", k) for k in spec.grid),
                       *((f"points[{i}].{k}", k) for i, p in enumerate(spec.points) for k in p)]:
        _check_key(path, where, key)
    return spec


def _check_key(path: str | os.PathLike, where: str, key: str) -> None:
    """``key`` names a config field (or a key of a free mapping such as ``launch.env``).

    Raises:
        ConfigError: naming the sweep file, the grid (or point) entry and the fields that exist there.
    """
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.structured(Config)
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(OmegaConf.get_type(node)):
            return  # a mapping of free keys (launch.env, reward.kwargs), or a value
        if part not in node:
            section = ".".join(parts[:i])
            raise ConfigError(f"{path}: {where}: {'.'.join(parts[:i + 1])} is not a config field; the fields of "
                              f"{section or 'the config'} are {', '.join(sorted(node.keys()))}")
        node = node[part]


def _value_text(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else ("null" if v is None else str(v).lower()
                                                              if isinstance(v, bool) else str(v))


def point_names(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix of each key that no other key ends with (``actor.parallel.tp`` -> ``tp``,
    unless ``rollout.tp`` is also swept: then ``parallel.tp`` and ``rollout.tp``)."""
    short = {}
    for k in keys:
        parts = k.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(o != k and (o == suffix or o.endswith("." + suffix)) for o in keys):
                short[k] = suffix
                break
        else:
            short[k] = k
    return short


def expand(spec: SweepSpec) -> list[Point]:
    """The grid's product and the extra points, in order, each named by its values (``tp1_pp2``)."""
    combos = [dict(zip(spec.grid, vals)) for vals in itertools.product(*spec.grid.values())] if spec.grid else []
    combos += [dict(p) for p in spec.points]
    short = point_names(sorted({k for c in combos for k in c}))
    points, seen = [], set()
    for values in combos:
        name = "_".join(f"{short[k]}{_value_text(v)}" for k, v in values.items()).replace("/", "-") or "base"
        if name in seen:
            continue
        seen.add(name)
        points.append(Point(name, values, [f"{k}={_value_text(v)}" for k, v in values.items()]))
    return points


def device_memory(spec: SweepSpec, shape: JobShape) -> int:
    """Bytes one rank may use: ``device_memory_gib``, else the local GPU's, else host memory per rank.

    Raises:
        ConfigError: a GPU sweep without ``device_memory_gib`` on a machine without a GPU.
    """
    if spec.device_memory_gib:
        return int(spec.device_memory_gib * GIB)
    if shape.gpus_per_node:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device_memory_gib: a GPU sweep planned on a machine without a GPU needs the "
                              "GPU's memory, e.g. device_memory_gib: 140 (H200)")
        return torch.cuda.get_device_properties(0).total_memory
    return host_memory_bytes() // shape.ranks_per_node


def check_point(spec: SweepSpec, point: Point, shape: JobShape, memory: int | None, *,
                full: bool = False) -> Config | None:
    """Validate one point; set ``point.reason`` and return None if it cannot run, else its config (and
    ``point.estimate``; a derived DP size is added to ``point.overrides``, so every point names its layout).

    The checks, in order: the config itself; TP/PP against the model's heads, KV heads and layers; the mesh
    against the job's world and the batch sizes against DP; with ``full``, the rest of a run's preflight
    (tokenizer, files, reward function; :func:`~megarl.trainer.preflight.preflight`, less this machine's
    checks); the memory estimate against ``memory`` (None: not estimated), and on GPUs vLLM's weights against
    its reservation (:func:`~megarl.launch.memory.check_rollout_weights`).
    """
    from megarl.models.spec import SpecError
    from megarl.trainer.preflight import model_spec, preflight, validate_for_model

    try:
        # as the point's megarl bench step loads it (no validation: it times steps)
        cfg = load_config(spec.base, spec.overrides + point.overrides + ["validation.enabled=false"])
        model = model_spec(cfg)
        validate_for_model(cfg, model)
        p = cfg.actor.parallel
        if shape.world_size % p.replica_size == 0 and not p.dp and cfg.placement.actor == "all":
            point.overrides.append(f"actor.parallel.dp={shape.world_size // p.replica_size}")
            cfg.actor.parallel.dp = shape.world_size // p.replica_size
        check_job_shape(cfg, shape)
        if full:
            preflight(cfg, shape.world_size, this_machine=False)
        if memory is None:
            return cfg
        point.estimate = est = estimate_memory(cfg, model, shape.world_size, gpu=shape.gpus_per_node > 0,
                                               device_bytes=memory)
        if shape.gpus_per_node:
            check_rollout_weights(cfg, model, memory)
    except (ConfigError, SpecError) as e:
        point.reason = str(e)
        return None
    if est.total > memory:
        point.reason = (f"estimated memory {est.describe()} per rank is over the device's "
                        f"{memory / GIB:.1f} GiB")
        return None
    return cfg


# ------------------------------------------------------------------------------------------------ running
def bench_command(spec: SweepSpec, point: Point, python: str, result: Path) -> list[str]:
    """``megarl bench step`` of one point (run once per rank under srun, or plainly: it starts torchrun)."""
    return [python, "-m", "megarl.cli", "bench", "step", *([spec.base] if spec.base else []), *spec.overrides,
            *point.overrides, "--steps", str(spec.bench.steps), "--warmup", str(spec.bench.warmup),
            "--json", str(result)]


def _result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _error_line(log: Path) -> str:
    """The last line of a log that reads like the error (``megarl: error:``, ``...Error: ...``)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    hits = [ln for ln in lines if "megarl: error:" in ln or "Error:" in ln or "error:" in ln
            or "CANCELLED" in ln or "DUE TO TIME LIMIT" in ln or "oom" in ln.lower()]
    return (hits or lines or [""])[-1][-400:]


def record_failure(point: Point, result: Path, why: str, log: Path) -> None:
    """Write the failed point's result file (keeping ``megarl bench step``'s own error when it wrote one)."""
    got = _result(result) or {}
    reason = got.get("error") or _error_line(log) or "no result written"
    got.update(status="failed" if got.get("status", "ok") == "ok" else got["status"], point=point.name,
               reason=f"{why}: {reason}", config={"overrides": point.overrides, **got.get("config", {})})
    write_beside(result, lambda tmp: tmp.write_text(json.dumps(got, indent=2, default=str)), "sweep")


def run_local(spec: SweepSpec, todo: list[Point], python: str) -> None:
    """Run the points one after another on this machine (``megarl bench step`` starts torchrun)."""
    out = spec.out_dir
    for point in todo:
        result, log = out / "results" / f"{point.name}.json", out / "logs" / f"{point.name}.out"
        print(f"sweep: running {point.name}", flush=True)
        result.unlink(missing_ok=True)  # a failed result being retried
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
        with log.open("a") as f:  # a log of an earlier attempt stays
            rc = subprocess.run(bench_command(spec, point, python, result), stdout=f, stderr=subprocess.STDOUT,
                                env=env).returncode
        if rc != 0 or (_result(result) or {}).get("status") != "ok":
            record_failure(point, result, f"exit code {rc}", log)


def array_script(spec: SweepSpec, cfg: Config, todo: list[Point], shape: JobShape, opts: SbatchOptions,
                 python: str, cwd: str) -> str:
    """One job array: task ``i`` runs point ``todo[i]`` with one srun task per rank."""
    out = spec.out_dir
    body = ['case "$SLURM_ARRAY_TASK_ID" in']
    for i, point in enumerate(todo):
        cmd = shlex.join(bench_command(spec, point, python, out / "results" / f"{point.name}.json"))
        note = shlex.quote(f"megarl sweep: point {point.name}")
        body.append(f"  {i}) echo {note}; {srun_prefix(opts, cwd)} {cmd} ;;")
    body.append("esac")
    return batch_script(cfg, shape, opts, cwd=cwd, output=str(out / "logs" / "%x-%A_%a.out"),
                        title=f"megarl sweep {spec.name}: {len(todo)} points as a job array, {shape.describe()} "
                              "each", body=body, array=f"0-{len(todo) - 1}")


def job_states(job: str) -> dict[int, str]:
    """``{array task: "STATE exit N:S"}`` of a finished job array, from ``scontrol show job``."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    states = {}
    for line in out.splitlines():
        f = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if "ArrayTaskId" in f and f["ArrayTaskId"].isdigit():
            states[int(f["ArrayTaskId"])] = f"{f.get('JobState', '?')} (exit {f.get('ExitCode', '?')})"
    return states


def run_slurm(spec: SweepSpec, cfg: Config, todo: list[Point], shape: JobShape, opts: SbatchOptions,
              python: str, poll_s: float = 2.0) -> None:
    """Submit the points as one job array, wait for it (``squeue``), record the points that wrote no result."""
    out = spec.out_dir
    script = write_beside(out / SCRIPT, lambda tmp: tmp.write_text(array_script(spec, cfg, todo, shape, opts, python,
                                                                                 os.getcwd())), "sweep")
    for point in todo:
        (out / "results" / f"{point.name}.json").unlink(missing_ok=True)  # a failed result being retried
    job = sbatch(script, written=SCRIPT)
    print(f"sweep: submitted job array {job} ({len(todo)} points); logs in {out / 'logs'}", flush=True)
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        time.sleep(poll_s)
    states = job_states(job)
    for i, point in enumerate(todo):
        result = out / "results" / f"{point.name}.json"
        if (_result(result) or {}).get("status") != "ok":
            record_failure(point, result, f"job {job}_{i} {states.get(i, 'ended')}",
                           out / "logs" / f"{opts.job_name}-{job}_{i}.out")


# ------------------------------------------------------------------------------------------------ report
# peak_memory_gib: megarl bench step's peak (torch's allocator on a GPU, resident memory on the CPU);
# device_memory_used_gib: NVML's device memory in use (everything on the GPU); estimated_*: megarl.launch.memory
COLUMNS = ["point", "status", "world_size", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu",
           "peak_memory_gib", "device_memory_used_gib", "estimated_memory_gib", "estimated_tensors_gib", "reason"]


def collect(spec: SweepSpec, points: list[Point]) -> list[dict[str, Any]]:
    """One row per point that ran (or failed): its swept values and benchmark figures, best first."""
    rows = []
    for p in points:
        r = _result(spec.out_dir / "results" / f"{p.name}.json")
        if p.reason or r is None:
            continue
        util = r.get("gpu_util") or {}
        used = util.get("memory_max_bytes") if util.get("source") == "nvml" else None
        rows.append({"point": p.name, **p.values, "status": r.get("status"), "world_size": r.get("world_size"),
                     "step_time_s": r.get("step_time_s"), "tokens_per_s": r.get("tokens_per_s"),
                     "tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"),
                     "peak_memory_gib": _gib(r.get("peak_memory_bytes")), "device_memory_used_gib": _gib(used),
                     "estimated_memory_gib": _gib(p.estimate.total) if p.estimate else None,
                     "estimated_tensors_gib": _gib(p.estimate.tensors) if p.estimate else None,
                     "reason": r.get("reason") or r.get("error")})
    return sorted(rows, key=lambda row: (row["status"] != "ok", -(row["tokens_per_s"] or 0)))


def _gib(v: int | None) -> float | None:
    return v / GIB if v else None


def _fmt(v: Any) -> str:
    return "" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v).replace("|", "\\|")


def write_report(spec: SweepSpec, points: list[Point]) -> dict[str, Path]:
    """``results.csv``, ``results.md`` (sorted by tokens/s; dropped points and reasons below) and
    ``throughput.png`` (tokens/s/GPU per point) in the sweep's folder, each written beside and renamed there."""
    out = spec.out_dir
    rows = collect(spec, points)
    swept = list(dict.fromkeys(k for p in points for k in p.values))
    cols = ["point", *swept, *COLUMNS[1:]]

    def table(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    write_beside(out / "results.csv", table, "sweep")
    md = [f"# Sweep {spec.name}: {len(rows)} points ran, {sum(r['status'] == 'ok' for r in rows)} finished", "",
          "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    dropped = [p for p in points if p.reason]
    md += ["", f"## Dropped before running ({len(dropped)})", ""]
    md += [f"- `{p.name}`: {p.reason}" for p in dropped] or ["none"]
    write_beside(out / "results.md", lambda tmp: tmp.write_text("\n".join(md) + "\n"), "sweep")
    write_beside(out / "throughput.png", lambda tmp: _plot(rows, tmp, spec.name), "sweep")
    return {"csv": out / "results.csv", "markdown": out / "results.md", "plot": out / "throughput.png"}


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["point"] for r in rows][::-1]
    values = [r["tokens_per_s_per_gpu"] or 0.0 for r in rows][::-1]
    colors = ["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.4 * max(1, len(rows))))
    ax.barh(names, values, color=colors)
    for y, (v, c) in enumerate(zip(values, colors)):
        ax.text(v, y, " failed" if c == "tab:red" else f" {v:.3g}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s per GPU (rank)")
    ax.set_title(f"sweep {title}: throughput per layout (red: failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ the CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``megarl sweep`` (registered in :mod:`megarl.cli`)."""
    p.add_argument("sweep", help="sweep file (parallel_configs/sweeps/)")
    mode = p.add_mutually_exclusive_group()  # one of them, or --check alone (run())
    mode.add_argument("--slurm", action="store_true", help="run the points as one SLURM job array and wait")
    mode.add_argument("--local", action="store_true", help="run the points one after another on this machine")
    mode.add_argument("--plan", action="store_true", help="list the points and the dropped ones; run nothing")
    p.add_argument("--retry-failed", action="store_true", help="run the points recorded as failed again")
    p.add_argument("--overwrite", action="store_true", help="run a sweep that ran before in its folder again, "
                   "replacing its table, CSV, plot, sweep.json and job script (its points' results are kept). "
                   "Default: refuse")
    p.add_argument("--check", action="store_true", help="check every point's config against its model, files and "
                   "reward function, as a run would (not the memory estimate, which needs the device); exit 1 if "
                   "a point is dropped; run nothing")
    add_sbatch_arguments(p)


def run(a: argparse.Namespace) -> int:
    """Expand, prune, run what has no result yet, and write the table, CSV and plot.

    Raises:
        ConfigError: no mode (``--slurm``, ``--local``, ``--plan``) and no ``--check``; a sweep file, grid key or
            point that cannot run (named).
    """
    if not (a.slurm or a.local or a.plan or a.check):
        raise ConfigError("sweep: give one of --slurm, --local or --plan (or --check alone to check every point "
                          "and run nothing); see megarl sweep --help")
    spec = load_sweep(a.sweep)
    shape = JobShape(spec.job.nodes, spec.job.gpus_per_node, spec.job.ntasks_per_node)
    opts, python = sbatch_options_from_args(a, f"megarl-sweep-{spec.name}", shape)
    memory = None if a.check else device_memory(spec, shape)
    points = expand(spec)
    configs = {p.name: check_point(spec, p, shape, memory, full=a.check) for p in points}
    valid = [p for p in points if p.reason is None]
    per_rank = f" ({memory / GIB:.1f} GiB per rank)" if memory else ""
    print(f"sweep {spec.name}: {len(points)} points, {len(valid)} valid on {shape.describe()}{per_rank}, "
          f"{len(points) - len(valid)} dropped:", flush=True)
    for p in points:
        if p.reason:
            print(f"  dropped {p.name}: {p.reason}", flush=True)
    if a.check:
        print(f"megarl sweep: check {'passed' if len(valid) == len(points) else 'failed'}; nothing was run")
        return 0 if len(valid) == len(points) else 1
    if not valid and not a.plan:
        raise ConfigError(f"sweep {spec.name}: every point was dropped (reasons above); nothing to run")
    if a.plan:
        for p in valid:
            print(f"  valid {p.name}: estimated {p.estimate.describe()} per rank")
        return 0
    out = spec.out_dir
    claim_outputs([out / name for name in (*SUMMARY, *([SCRIPT] if a.slurm else []))], "sweep", overwrite=a.overwrite,
                  alternative=f", or give the sweep another name than {spec.name!r}")
    for d in ("results", "logs"):
        (out / d).mkdir(parents=True, exist_ok=True)

    def done(p: Point) -> bool:
        r = _result(out / "results" / f"{p.name}.json")
        return r is not None and (r.get("status") == "ok" or not a.retry_failed)

    todo = [p for p in valid if not done(p)]
    print(f"sweep {spec.name}: {len(valid) - len(todo)} points already have results, {len(todo)} to run",
          flush=True)
    if todo and a.slurm:
        run_slurm(spec, configs[todo[0].name], todo, shape, opts, python)
    elif todo:
        run_local(spec, todo, python)
    record = {"name": spec.name, "job": shape.describe(), "device_memory_bytes": memory,
              "points": [{"name": p.name, "values": p.values, "overrides": p.overrides, "dropped": p.reason,
                          "estimate": p.estimate.as_dict() if p.estimate else None} for p in points]}
    write_beside(out / "sweep.json", lambda tmp: tmp.write_text(json.dumps(record, indent=2, default=str)), "sweep")
    files = write_report(spec, points)
    print((out / "results.md").read_text(), end="")
    print("sweep: wrote " + ", ".join(str(f) for f in files.values()), flush=True)
    return 0
