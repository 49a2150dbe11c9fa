"""``megarl submit``: a training run as one SLURM batch job.

    megarl submit CONFIG.yaml [key=value ...] --nodes N --gpus-per-node G [--partition P] [--time T] ...

The batch script is written into the run folder (``<run.output_dir>/<run.name>/job.sbatch``, so the job can be
re-submitted by hand with ``sbatch``) and submitted; the command prints the job id and the log path. The
script:

1. asks for ``N`` nodes with one task per GPU (``--ntasks-per-node=G --gpus-per-node=G``; with
   ``--gpus-per-node 0``, CPU ranks: ``--ntasks-per-node``), its log in ``<run folder>/logs/<job name>-<job
   id>.out``, and the submitting directory as its working directory (relative config paths keep working);
2. exports the ranks' environment, the config's ``launch.env`` (NCCL/torch defaults in
   :data:`megarl.config.LAUNCH_ENV`);
3. sets the rendezvous: ``MASTER_ADDR`` = the first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``,
   ``MASTER_PORT`` = 20000 + job id mod 20000 (two jobs sharing a node get different ports);
4. ``srun`` starts ``megarl train`` once per rank; each rank reads ``SLURM_PROCID``/``SLURM_NTASKS``/
   ``SLURM_LOCALID`` (:func:`megarl.parallel.mesh.launch_info`).

Before anything is written or submitted, the config is validated against the job's shape (nodes x ranks per
node must be the actor's TP x PP x DP, the batch sizes must fit every role: :func:`check_job_shape`).
``--resume`` re-submits a run from the newest checkpoint in its folder (``trainer.resume=true``; raise
``trainer.steps`` to add steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config import Config, ConfigError, load_config

SCRIPT_NAME = "job.sbatch"
GPU_CPUS_PER_TASK = 8  # default --cpus-per-task of a GPU rank (data loading, tokenisation, rewards, NCCL threads)
PORT_BASE, PORT_SPAN = 20000, 20000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN (as megarl.parallel.mesh)


@dataclass(frozen=True)
class JobShape:
    """The ranks of a job: ``nodes`` x ``gpus_per_node`` GPU ranks, or ``nodes`` x ``ntasks_per_node`` CPU
    ranks when ``gpus_per_node`` is 0.

    Raises:
        ConfigError: a size below 1 (naming the flag), or ``--ntasks-per-node`` differing from the GPUs.
    """

    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int | None = None

    def __post_init__(self):
        if self.nodes < 1:
            raise ConfigError(f"--nodes: must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node: must be >= 0 (0: CPU ranks), got {self.gpus_per_node}")
        if self.ntasks_per_node is not None and self.ntasks_per_node < 1:
            raise ConfigError(f"--ntasks-per-node: must be >= 1, got {self.ntasks_per_node}")
        if self.gpus_per_node and self.ntasks_per_node not in (None, self.gpus_per_node):
            raise ConfigError(f"--ntasks-per-node {self.ntasks_per_node}: a GPU job runs one rank per GPU "
                              f"(--gpus-per-node {self.gpus_per_node}); omit --ntasks-per-node")

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.ntasks_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        per = f"{self.gpus_per_node} GPUs" if self.gpus_per_node else f"{self.ranks_per_node} CPU ranks"
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {per} = {self.world_size} ranks"

    def flags(self) -> str:
        per = (f"--gpus-per-node {self.gpus_per_node}" if self.gpus_per_node
               else f"--ntasks-per-node {self.ranks_per_node}")
        return f"--nodes {self.nodes} x {per}"


@dataclass
class SbatchOptions:
    """sbatch's choices for a job (each ``None`` is left to the cluster's defaults).

    Attributes:
        job_name: ``--job-name`` (also names the log file).
        partition, account, time, qos: the sbatch options of the same names (``time``: e.g. ``04:00:00``).
        cpus_per_task: ``--cpus-per-task``, the ranks' ``OMP_NUM_THREADS`` (without it: the node's allocated
            CPUs over its tasks).
        mem: ``--mem`` per node (``0``: all of it; e.g. ``64G``).
        container_image, container_mounts: pyxis's ``srun --container-image/--container-mounts``.
        extra: further ``#SBATCH`` arguments, verbatim (``--exclusive``, ``--mem=0``, ...).
    """

    job_name: str
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    extra: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(f"--cpus-per-task: must be >= 1, got {self.cpus_per_task}")


def check_job_shape(cfg: Config, shape: JobShape) -> None:
    """The config runs on this job: nodes x ranks per node = the actor's TP x PP x DP (DP derived when
    ``actor.parallel.dp`` is 0; with the actor on a pool of its own, its pool), and every role's layout and
    batch sizes fit (:func:`megarl.parallel.placement.validate_for_world`).

    Raises:
        ConfigError: naming the config fields and the job's flags.
    """
    from megarl.parallel.placement import validate_for_world  # (torch: not imported for --help)

    p = cfg.actor.parallel
    on_all = cfg.placement.actor == "all"  # an actor on a pool of its own: validate_for_world checks the pool
    mp = p.replica_size
    if on_all and (shape.world_size % mp or (p.dp and mp * p.dp != shape.world_size)):
        need = f"tp={p.tp} x pp={p.pp}" + (f" x cp={p.cp}" if p.cp > 1 else "") + (
            f" x dp={p.dp} = {mp * p.dp}" if p.dp else f" = {mp} (times dp)")
        raise ConfigError(f"actor.parallel.tp/pp/dp: the job has {shape.flags()} = {shape.world_size} ranks, but "
                          f"the actor's mesh needs {need}; change --nodes/--gpus-per-node or the mesh")
    validate_for_world(cfg, shape.world_size)


def rank_environment(cfg: Config) -> list[str]:
    """The ``export`` lines of the config's ``launch.env`` (a null value becomes a comment)."""
    return [f"export {k}={shlex.quote(v)}" if v is not None else f"# {k} not set (launch.env.{k})"
            for k, v in cfg.launch.env.items()]


def batch_script(cfg: Config, shape: JobShape, opts: SbatchOptions, *, cwd: str, output: str, title: str,
                 body: list[str], array: str | None = None) -> str:
    """A batch script: ``#SBATCH`` lines of ``shape``/``opts``, the ranks' environment, the rendezvous, then
    ``body`` (shell lines that call :func:`srun_prefix`).

    Args:
        cwd: the job's working directory (``--chdir``). output: its log path (``%x`` job name, ``%j`` id,
            ``%A``/``%a`` array job/task).
        title: the first comment lines (what the job runs). array: ``--array`` (e.g. ``0-5``) or None.
    """
    sb = [f"--job-name={opts.job_name}", f"--nodes={shape.nodes}", f"--ntasks-per-node={shape.ranks_per_node}"]
    sb += [f"--gpus-per-node={shape.gpus_per_node}"] if shape.gpus_per_node else []
    sb += [f"--cpus-per-task={opts.cpus_per_task}"] if opts.cpus_per_task else []
    sb += [f"--mem={opts.mem}"] if opts.mem is not None else []
    sb += [f"--{k}={v}" for k, v in (("partition", opts.partition), ("account", opts.account),
                                      ("time", opts.time), ("qos", opts.qos)) if v]
    sb += [f"--array={array}"] if array else []
    sb += [f"--output={output}", f"--chdir={cwd}", *opts.extra]
    lines = ["#!/bin/bash", *(f"# {t}" for t in title.splitlines()), *(f"#SBATCH {s}" for s in sb),
             "set -euo pipefail", "",
             "# the ranks' environment: the config's launch.env (override: launch.env.NAME=VALUE, or =null)",
             "# threads per rank: --cpus-per-task, else the node's allocated CPUs over its tasks",
             'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-$(( ${SLURM_CPUS_ON_NODE:-1} / '
             '${SLURM_NTASKS_PER_NODE:-1} > 1 ? ${SLURM_CPUS_ON_NODE:-1} / ${SLURM_NTASKS_PER_NODE:-1} : 1 ))}"',
             *rank_environment(cfg), "",
             "# rendezvous: the job's first node, a port derived from the job id",
             'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             f"export MASTER_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
             'echo "megarl: job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NODELIST, '
             'rendezvous $MASTER_ADDR:$MASTER_PORT"', "", *body]
    return "\n".join(lines) + "\n"


def srun_prefix(opts: SbatchOptions, cwd: str) -> str:
    """``srun`` with one task per rank of the allocation (the ``#SBATCH`` lines), ending the job when a rank
    fails, inside the pyxis container when one is given."""
    args = ["srun", "--kill-on-bad-exit=1"]
    if opts.container_image:
        args += [f"--container-image={opts.container_image}", f"--container-workdir={cwd}"]
        args += [f"--container-mounts={opts.container_mounts}"] if opts.container_mounts else []
    return shlex.join(args)


def train_script(cfg: Config, config: str | None, overrides: list[str], shape: JobShape, opts: SbatchOptions,
                 *, python: str, cwd: str, dry_run: bool = False) -> str:
    """The batch script of ``megarl train CONFIG overrides`` on ``shape`` (see the module docstring); with
    ``dry_run``, its header says that nothing was written and how to submit it by hand."""
    run_dir = cfg.run.run_dir
    train = shlex.join([python, "-m", "megarl.cli", "train", *([config] if config else []), *overrides])
    title = f"megarl submit: {shape.describe()} of megarl train {shlex.join([config or '(defaults)', *overrides])}"
    if dry_run:
        title += (f"\n--dry-run: nothing was written. megarl submit without --dry-run writes this script to "
                  f"{run_dir / SCRIPT_NAME},\ncreates {run_dir / 'logs'} (sbatch does not) and submits it; by hand: "
                  f"mkdir -p {run_dir / 'logs'} && sbatch {run_dir / SCRIPT_NAME}")
    else:
        title += f"\nre-submit by hand: sbatch {run_dir / SCRIPT_NAME}"
    body = f"{srun_prefix(opts, cwd)} {train}"
    launch = cfg.launch
    if launch.max_restarts or launch.save_before_end_s:
        extra = ["--requeue", "--open-mode=append"]
        extra += [f"--signal=USR1@{launch.save_before_end_s}"] if launch.save_before_end_s else []
        opts = dataclasses.replace(opts, extra=[*extra, *opts.extra])
        body = (f"# restarts: up to launch.max_restarts={launch.max_restarts} after a failure (srun again in this "
                f"allocation), a requeue after each save on SIGUSR1 (megarl.launch.supervise)\n"
                + shlex.join([python, "-m", "megarl.launch.supervise", f"--run-dir={run_dir}",
                              f"--max-restarts={launch.max_restarts}", "--slurm", "--"]) + f" {body}")
    return batch_script(cfg, shape, opts, cwd=cwd, output=str(run_dir / "logs" / "%x-%j.out"), title=title,
                        body=[body])


def sbatch(script: Path, *, written: str = "the batch script") -> str:
    """Submit a batch script; returns the job id.

    Args:
        written: what ``script`` is, for the error's "is written at" (e.g. "sweep.sbatch").

    Raises:
        ConfigError: sbatch is not installed here (naming where the script is, to submit it elsewhere with
            ``sbatch``), or refused the job (its message included).
    """
    if shutil.which("sbatch") is None:
        raise ConfigError(f"sbatch not found: submit from a SLURM login node; {written} is written at {script} "
                          f"(submit it there with: sbatch {script})")
    from megarl.parallel.lifecycle import OWNER_ENV

    # sbatch hands its environment to the job, which must not count as this process's helper (ended with it)
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip().split(";")[0]


# ------------------------------------------------------------------------------------------------ the CLI
_SLURM_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)")


def slurm_time(text: str) -> str:
    """An argparse ``type`` for ``--time``: one of sbatch's forms (``M``, ``M:S``, ``H:M:S``, ``D-H``,
    ``D-H:M``, ``D-H:M:S``, ``UNLIMITED``), checked here rather than by sbatch after the run folder exists.

    Raises:
        argparse.ArgumentTypeError: naming ``--time`` and the forms.
    """
    if not _SLURM_TIME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"--time {text!r} is not a SLURM time limit; use minutes, H:MM:SS or "
                                         "D-HH:MM:SS, e.g. 04:00:00")
    return text


def add_sbatch_arguments(p: argparse.ArgumentParser) -> None:
    """sbatch's flags, shared by ``megarl submit`` and ``megarl sweep --slurm``."""
    g = p.add_argument_group("sbatch")
    g.add_argument("--partition")
    g.add_argument("--account")
    g.add_argument("--time", type=slurm_time, help="time limit, e.g. 04:00:00 or 2-00:00:00 (sbatch's forms)")
    g.add_argument("--qos")
    g.add_argument("--job-name", help="default: megarl-<run.name> (megarl-sweep-<name> for a sweep)")
    g.add_argument("--cpus-per-task", type=int, default=None, help=f"CPU cores per rank, its OMP_NUM_THREADS "
                   f"(default: {GPU_CPUS_PER_TASK} for GPU ranks; for CPU ranks the node's allocated CPUs over "
                   "its tasks)")
    g.add_argument("--mem", default=None, help="memory per node, sbatch's --mem (default: 0, all of it, for GPU "
                   "jobs; the cluster's default for CPU ranks); e.g. 256G")
    g.add_argument("--container-image", help="pyxis: run the ranks in this container image")
    g.add_argument("--container-mounts", help="pyxis: SRC:DST[,...] mounted into the container")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="any other sbatch argument, verbatim (repeatable), e.g. --sbatch-arg=--exclusive")
    g.add_argument("--python", default=None, help="the ranks' interpreter (default: this one; in a container: "
                   "python)")


def sbatch_options_from_args(a: argparse.Namespace, default_name: str, shape: JobShape) -> tuple[SbatchOptions, str]:
    """The sbatch options and the ranks' interpreter of the parsed :func:`add_sbatch_arguments` flags; a GPU
    job asks for :data:`GPU_CPUS_PER_TASK` cores per rank and all of each node's memory unless told otherwise
    (clusters' defaults, often one core and a few GiB per task, starve a rank or kill it)."""
    gpu = shape.gpus_per_node > 0
    cpus = a.cpus_per_task if a.cpus_per_task is not None else (GPU_CPUS_PER_TASK if gpu else None)
    mem = a.mem if a.mem is not None else ("0" if gpu else None)
    opts = SbatchOptions(job_name=a.job_name or default_name, partition=a.partition, account=a.account,
                         time=a.time, qos=a.qos, cpus_per_task=cpus, mem=mem, container_image=a.container_image,
                         container_mounts=a.container_mounts, extra=list(a.sbatch_arg))
    return opts, a.python or ("python" if a.container_image else sys.executable)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``megarl submit`` (registered in :mod:`megarl.cli`)."""
    p.add_argument("config", nargs="?", help="YAML file (parallel_configs/...); omitted: the CPU default")
    p.add_argument("overrides", nargs="*", help="dotted overrides (before the flags), e.g. trainer.steps=2")
    p.add_argument("--resume", action="store_true", help="re-submit the run from its newest checkpoint")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="requeue the job after a failure up to N times, each from the newest checkpoint "
                        "(launch.max_restarts; default from the config: 0)")
    p.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    g = p.add_argument_group("job shape")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node, one rank each (0: CPU ranks)")
    g.add_argument("--ntasks-per-node", type=int, default=None,
                   help="CPU ranks per node (with --gpus-per-node 0; default 1)")
    add_sbatch_arguments(p)


def run(a: argparse.Namespace) -> int:
    """Validate, write the batch script into the run folder, submit it, print the job id and log path."""
    config, overrides = a.config, list(a.overrides) + (["trainer.resume=true"] if a.resume else [])
    overrides += [f"launch.max_restarts={a.max_restarts}"] if a.max_restarts is not None else []
    cfg = load_config(config, overrides)
    shape = JobShape(a.nodes, a.gpus_per_node, a.ntasks_per_node)
    opts, python = sbatch_options_from_args(a, f"megarl-{cfg.run.name}", shape)
    check_job_shape(cfg, shape)
    from megarl.trainer.preflight import model_spec, validate_for_model

    validate_for_model(cfg, model_spec(cfg))  # as train and sweep --plan: a model that exists and fits the mesh
    cwd = os.getcwd()
    script = train_script(cfg, config, overrides, shape, opts, python=python, cwd=cwd, dry_run=a.dry_run)
    if a.dry_run:
        print(script, end="")
        return 0
    run_dir = Path(cwd) / cfg.run.run_dir
    from megarl.trainer.checkpointing import check_run_folder

    check_run_folder(cfg, shape.world_size)  # before the queue: no checkpoint to resume, a finished run, ...
    from megarl.storage import check_writable

    check_writable(run_dir, "run.output_dir")  # a file in the way, a read-only or full file system
    if a.resume:
        from megarl.models.checkpoint import latest_checkpoint

        print(f"resuming from {latest_checkpoint(run_dir)}")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / SCRIPT_NAME
    path.write_text(script)
    job = sbatch(path)
    print(f"submitted job {job}: {shape.describe()}\n"
          f"  script   {path}\n"
          f"  log      {run_dir / 'logs' / f'{opts.job_name}-{job}.out'}\n"
          f"  metrics  {run_dir / 'metrics.jsonl'} (summary: {run_dir / 'summary.json'})\n"
          f"  follow with: squeue -j {job}; cancel with: scancel {job}")
    return 0
