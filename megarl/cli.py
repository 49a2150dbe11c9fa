"""The ``megarl`` command: one argparse tree of subcommands.

    megarl train [CONFIG.yaml] [key=value ...] [--resume]   RL training (no config: the CPU default)
    megarl convert SRC OUT [--tp T] [--pp P] [--vpp V] [--dtype D] [--overwrite]
                                                            HF directory / GGUF -> megarl checkpoint
    megarl export CKPT OUT [--overwrite]                    megarl checkpoint -> HF directory
    megarl data gsm8k --src DIR|hub --out DIR [--overwrite] prepare GSM8K parquet files
    megarl data arithmetic --out DIR [--overwrite]          write the arithmetic task's parquet files
    megarl data calculator --out DIR [--overwrite]          write the calculator task's parquet files
    megarl sft [CONFIG.yaml] [key=value ...] [--resume]     supervised fine-tuning (chat, prompt/completion)
    megarl dpo [CONFIG.yaml] [key=value ...] [--resume]     DPO on chosen/rejected pairs
    megarl eval MODEL [CONFIG.yaml] [key=value ...]         held-out accuracy of a model or checkpoint
    megarl report RUN_DIR                                   plots and a markdown page of a run
    megarl bench reshard ...                                reshard benchmark (see --help)
    megarl bench step [CONFIG.yaml] [key=value ...] --steps N --warmup K [--json PATH]
                                                            RL step benchmark: per-phase tokens/s/GPU, MFU
    megarl bench gate REPORT.json --case NAME [--tolerance F] [--append]
                                                            speed gate: the report against its case's history
    megarl submit [CONFIG.yaml] [key=value ...] --nodes N --gpus-per-node G [--dry-run] [--resume]
                                                            a training run as one SLURM batch job
    megarl sweep SWEEP.yaml (--slurm | --local | --plan)    benchmark a grid of layouts (SLURM job array)

Each subcommand registers itself with :func:`command` (its arguments and the function that runs it); a new
one adds a ``@command`` function below, not a parser of its own. Bad input ends in one line,
``megarl: error: <what> ...``, naming the flag or config field, before any process or model starts.

``megarl train`` runs under torchrun or SLURM's srun as given; started plainly for a config whose mesh needs
several ranks, it relaunches itself with ``torchrun --nproc_per_node=<world size>`` on this node; those ranks
end with it, SIGKILL included (:mod:`megarl.parallel.lifecycle`), and a run folder has one run at a time
(:mod:`megarl.trainer.run_lock`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn


class UsageError(ValueError):
    """Bad command-line input; the message names the flag and the fix."""


class Interrupted(Exception):
    """The user stopped the command (Ctrl-C, or a SIGTERM to its launcher); the message says how to go on."""


class _Parser(argparse.ArgumentParser):
    """argparse with errors as one ``megarl: error:`` line (no usage dump), raised so :func:`main` prints it."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        where = self.prog.removeprefix("megarl").strip()
        raise UsageError(f"{where + ': ' if where else ''}{message} (see {self.prog} --help)")


def int_at_least(flag: str, low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= ``low`` whose error names ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}, got {value}")
        return value
    return parse


def positive_int(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 1 whose error names ``flag``."""
    return int_at_least(flag, 1)


def positive_float(flag: str, minimum: float | None = None) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number > 0 (>= ``minimum`` when given) whose error names ``flag``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number > 0, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number > 0, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum:g}, got {text}")
        return value
    return parse


_COMMANDS: list[tuple[tuple[str, ...], str, Callable]] = []


def command(*path: str, help: str):
    """Register ``fn(parser)`` as the builder of subcommand ``path`` (e.g. ``("bench", "reshard")``); the
    builder adds the arguments and returns the function ``run(args) -> int`` that executes the command."""
    def register(fn: Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]):
        _COMMANDS.append((path, help, fn))
        return fn
    return register


def split_config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``megarl CMD [CONFIG.yaml] [key=value ...]``: a first positional with ``=`` is an override."""
    if config and "=" in config:
        return None, [config, *overrides]
    return config, list(overrides)


def relaunch_world(cfg, argv: list[str], *, run_folder: bool = False, checks: Callable | None = None) -> bool:
    """Under torchrun or SLURM: False (this process is one rank). Started plainly: check ``cfg`` against its
    world size and its model (``checks(cfg, world_size) -> spec``; default :func:`megarl.trainer.preflight.
    preflight`), then, with ``run_folder``, that the
    run folder is free and its checkpoints fit the run; and when that is more than one rank, run ``megarl ARGV``
    under ``torchrun --nproc_per_node=<world size>`` on this node and return True once it has finished (its
    ranks end with this process, SIGKILL included: :mod:`megarl.parallel.lifecycle`).

    Raises:
        ConfigError: from :func:`~megarl.trainer.preflight.preflight`, naming the field, or from
            :func:`~megarl.trainer.checkpointing.check_run_folder`, before any process starts.
        RunLockedError: with ``run_folder``, another run owns the folder.
    """
    if is_rank():
        return False
    if checks is None:
        from megarl.trainer.preflight import preflight as checks

    spec = checks(cfg, cfg.world_size)  # first: a config error is named even while another run owns the folder
    if run_folder:
        from megarl.launch.memory import warn_host_memory
        from megarl.storage import check_writable
        from megarl.trainer.run_lock import check_free
        from megarl.trainer.checkpointing import check_run_folder

        check_free(cfg.run.run_dir)  # another run owns the folder
        check_writable(cfg.run.run_dir, "run.output_dir")  # a file in the way, a read-only or full file system
        check_run_folder(cfg, cfg.world_size)  # an earlier run's checkpoints, none to resume, a finished run
        warn_host_memory(cfg, spec, cfg.world_size)  # a GPU machine whose host will not hold a checkpoint save
    if cfg.world_size == 1:
        return False
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from megarl.parallel.lifecycle import mark_children

    mark_children()  # the ranks end with this process, SIGKILL included
    # each rank's threads: this machine's cores shared out (torchrun would set 1, with a banner saying so)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // cfg.world_size)))
    print(f"megarl: launching {cfg.world_size} processes with torchrun", flush=True)
    _quiet_torchrun_stop()
    try:
        torchrun([f"--nproc_per_node={cfg.world_size}", "--standalone", "-m", "megarl.cli", *argv])
    except SignalException:  # torchrun's agent got SIGINT/SIGTERM and has stopped the ranks
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        from megarl.parallel.restart import EXIT_REQUEUE, requeue_message, requeue_stop

        if requeue_stop(f.exitcode for f in e.failures.values()):  # saved on SIGUSR1: this launcher speaks for them
            from megarl.models.checkpoint import latest_checkpoint

            print(f"megarl: {requeue_message(latest_checkpoint(cfg.run.run_dir))}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_REQUEUE) from None
        failed = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in e.failures.items())
        print(f"megarl: error: megarl {argv[0]} failed on {failed}; see the ranks' messages above",
              file=sys.stderr)
        from megarl.parallel.restart import NOT_RETRIED

        # a rank's config, data or storage error keeps its status: a restart would fail again (launch.supervise)
        kept = [f.exitcode for f in e.failures.values() if f.exitcode in NOT_RETRIED]
        raise SystemExit(min(kept) if kept else 1) from None
    return True


def _quiet_torchrun_stop() -> None:
    """Drop torchrun's agent's lines about ranks ending: ``Sending process N closing signal SIGTERM`` (the ranks
    left once one has ended, always) and ``failed (exitcode: 75)`` (a stop for the requeue, not a failure):
    :func:`relaunch_world` says what happened in one line of its own."""
    import logging

    from megarl.parallel.restart import EXIT_REQUEUE

    def keep(record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("Sending process") and "closing signal" in msg:
            return False
        return not (msg.startswith("failed (exitcode:") and args[:1] == (EXIT_REQUEUE,))

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(keep)


OVERWRITE_HELP = ("write into a folder that holds other files, which stay as they are (a file of a name the "
                  "command writes is refused, never replaced; a training run's folder or checkpoint is refused "
                  "always). Default: only a new or empty folder, or one this command wrote")
CONVERT_OVERWRITE_HELP = ("replace a checkpoint that megarl convert wrote earlier, or write into a folder that holds "
                          "other files, which stay as they are (as for --overwrite of export). Default: only a new "
                          "or empty folder")
CHECK_HELP = ("check the config against its model, tokenizer, files and reward function (every check made "
              "before a run, less what this machine lacks, e.g. a GPU), print the result and run nothing")


def check_only(cfg, what: str, *, run_folder: bool = False) -> int:
    """``--check``: :func:`~megarl.trainer.preflight.preflight` of ``cfg`` without the checks of this machine
    (a GPU config checked on a CPU machine, as CI checks ``perf/gpu_*.sh``), and with ``run_folder`` what the
    run folder's checkpoints allow (:func:`~megarl.trainer.checkpointing.check_run_folder`, read only: a new run
    over an earlier run's checkpoints, a finished run, a checkpoint this config cannot resume). A ``--resume``
    whose folder holds no checkpoint yet is a warning on stderr, not a refusal: a script's earlier command may
    write it (``perf/gpu_resume.sh``, checked command by command). Prints one line; returns 0.

    Raises:
        ConfigError: naming the field, as a run would before starting.
    """
    from megarl.trainer.preflight import preflight

    spec = preflight(cfg, cfg.world_size, this_machine=False)
    if run_folder:
        from megarl.models.checkpoint import run_checkpoints
        from megarl.trainer.checkpointing import check_run_folder

        if cfg.trainer.resume and not run_checkpoints(cfg.run.run_dir):
            print(f"megarl {what}: warning: trainer.resume: the run folder {cfg.run.run_dir} holds no checkpoint "
                  "yet; the run would be refused unless one is written first (start it without --resume, or check "
                  "run.name and run.output_dir)", file=sys.stderr, flush=True)
        else:
            check_run_folder(cfg, cfg.world_size)
    print(f"megarl {what}: check passed ({cfg.world_size} rank(s), model {cfg.model.path}: {spec.num_layers} "
          f"layers, hidden {spec.hidden_size}); nothing was run", flush=True)
    return 0


def _rank() -> int:
    """This rank's global rank (torchrun's ``RANK``, srun's ``SLURM_PROCID``); 0 outside a job."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


def is_rank() -> bool:
    """Whether this process is one rank of a job (started by torchrun or SLURM), not a launcher."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


# ------------------------------------------------------------------------------------------------ commands
@command("train", help="RL post-training (PPO, GRPO, RLOO, REINFORCE++)")
def _train(p: argparse.ArgumentParser):
    p.add_argument("config", nargs="?", help="YAML file (parallel_configs/...); omitted: the CPU default")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=2 actor.optim.lr=1e-6")
    p.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    p.add_argument("--max-restarts", type=int_at_least("--max-restarts", 0), default=None, metavar="N",
                   help="run again from the newest checkpoint after a failure, up to N times "
                        "(launch.max_restarts; default from the config: 0)")
    p.add_argument("--check", action="store_true", help=CHECK_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.config import load_config

        config, overrides = split_config_and_overrides(a.config, a.overrides)
        overrides += ["trainer.resume=true"] if a.resume else []
        overrides += [f"launch.max_restarts={a.max_restarts}"] if a.max_restarts is not None else []
        cfg = load_config(config, overrides)  # fails here, before any process or model, on a bad config
        if a.check:
            return check_only(cfg, "train", run_folder=True)

        from megarl.parallel.restart import RESTART_ENV, watch_requeue_signal

        if not is_rank():  # the process the user (or a scheduler) signals: the supervisor, a launcher, a run of 1
            from megarl.parallel.lifecycle import stop_on_sigterm

            watch_requeue_signal()  # SIGUSR1: noted here (a run of one rank) and passed on to the ranks/attempt
            stop_on_sigterm()  # SIGTERM: stopped as Ctrl-C stops it (torchrun's agent, several ranks, does too)
        if cfg.launch.max_restarts and not is_rank() and RESTART_ENV not in os.environ:
            from megarl.launch.supervise import supervise_local  # each attempt a child launcher

            return supervise_local([sys.executable, "-m", "megarl.cli", "train", *a.argv], cfg.run.run_dir,
                                   cfg.launch.max_restarts)
        try:
            if relaunch_world(cfg, ["train", *a.argv], run_folder=True):
                return 0
            from megarl.trainer.trainer import train

            train(cfg)
        except KeyboardInterrupt:
            from megarl.models.checkpoint import latest_checkpoint

            newest = latest_checkpoint(cfg.run.run_dir)
            raise Interrupted(f"--resume continues the run from {newest}" if newest else
                              "no checkpoint was written yet: the run starts over") from None
        return 0
    return run


@command("sft", help="supervised fine-tuning on chat or prompt/completion data (megarl.offline)")
def _sft(p: argparse.ArgumentParser):
    from megarl.offline import command as offline

    offline.add_arguments(p)
    return lambda a: offline.run("sft", *split_config_and_overrides(a.config, a.overrides), a, relaunch_world)


@command("dpo", help="DPO on chosen/rejected pairs (megarl.offline)")
def _dpo(p: argparse.ArgumentParser):
    from megarl.offline import command as offline

    offline.add_arguments(p)
    return lambda a: offline.run("dpo", *split_config_and_overrides(a.config, a.overrides), a, relaunch_world)


def _checkpoint_run(model: str):
    """The run folder (absolute ``Path``) of ``model`` when it is a run's checkpoint, ``RUN/checkpoints/step_N``,
    else None."""
    from pathlib import Path

    path = Path(model.rstrip("/")).resolve()
    return path.parent.parent if model != "default" and path.parent.name == "checkpoints" else None


def _run_config(model: str) -> str | None:
    """The ``config.json`` of the run whose checkpoint ``model`` is, or None: an evaluation of a run's
    checkpoint prompts, scores and samples as that run did."""
    run = _checkpoint_run(model)
    return str(run / "config.json") if run is not None and (run / "config.json").is_file() else None


def _eval_name(model: str) -> str:
    """The default folder name of an evaluation: the model's name, and for a run's checkpoint
    (``RUN/checkpoints/step_N``) ``RUN-step_N``, so that the same step of two runs does not share a folder."""
    from pathlib import Path

    path = Path(model.rstrip("/")).resolve() if model != "default" else Path("default")
    run = _checkpoint_run(model)
    return f"{run.name}-{path.name}" if run is not None else path.name


@command("eval", help="evaluate a model on held-out prompts (the run's validation, outside a run)")
def _eval(p: argparse.ArgumentParser):
    p.add_argument("model", help="Hugging Face directory, .gguf file, megarl checkpoint, or 'default' (SmolLM2)")
    p.add_argument("config", nargs="?", help="YAML file; omitted: the run's config.json for a run's checkpoint "
                   "(its prompt template, reward and validation), else the CPU default")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. validation.num_prompts=0 "
                   "validation.max_new_tokens=512 rollout.engine=vllm")
    p.add_argument("--out", help="output folder for eval.json and eval_samples.jsonl, or eval-2.json, ... when "
                   "they exist (default: "
                   "<run.output_dir>/eval/<model name>, <run name>-step_<N> for a run's checkpoint)")
    p.add_argument("--check", action="store_true", help=CHECK_HELP)

    def run(a: argparse.Namespace) -> int:
        from pathlib import Path

        from megarl.config import load_config

        config, overrides = split_config_and_overrides(a.config, a.overrides)
        if config is None and (config := _run_config(a.model)):
            print(f"megarl eval: the run's config {config} (give a CONFIG.yaml to use another)", flush=True)
        cfg = load_config(config, overrides + [f"model.path={a.model}"])
        if a.check:
            return check_only(cfg, "eval")
        from megarl.trainer.evaluate import evaluate_model

        out = a.out or Path(cfg.run.output_dir) / "eval" / _eval_name(a.model)
        result = evaluate_model(cfg, out)
        import torch.distributed as dist

        if not is_rank() and dist.is_initialized():  # its own world of one: ended while the interpreter is whole
            dist.destroy_process_group()  # (gloo's threads at teardown aborted it now and then, as end_process says)
        if "files" not in result:  # a rank other than 0: rank 0 reports
            return 0
        m = result["metrics"]
        print(f"{a.model}: accuracy {m['val/accuracy']:.4f}, mean reward {m['val/reward_mean']:.4f}, response "
              f"length {m['val/response_length_mean']:.0f} tokens, {m['val/clip_ratio']:.0%} cut at max_new_tokens "
              f"({result['prompts']}); wrote {' and '.join(result['files'])}")
        return 0
    return run


@command("report", help="plots and a markdown page of a finished (or running) run")
def _report(p: argparse.ArgumentParser):
    p.add_argument("run_dir", help="a run folder, runs/<name> (metrics.jsonl, config.json, samples.jsonl)")

    def run(a: argparse.Namespace) -> int:
        try:
            from megarl.trainer.report import write_report
        except ImportError as e:
            raise UsageError(f"megarl report needs matplotlib ({e}): pip install 'megarl[report]'") from None
        print(f"wrote {write_report(a.run_dir)}")
        return 0
    return run


@command("convert", help="HF directory / GGUF -> megarl (Megatron dist) checkpoint")
def _convert(p: argparse.ArgumentParser):
    from megarl.config import DTYPES

    p.add_argument("src", help="Hugging Face directory, .gguf file, or 'default' (SmolLM2-135M-Instruct GGUF)")
    p.add_argument("out", help="output megarl checkpoint directory")
    p.add_argument("--tp", type=positive_int("--tp"), default=1, help="tensor-parallel size of the conversion world")
    p.add_argument("--pp", type=positive_int("--pp"), default=1,
                   help="pipeline-parallel size of the conversion world")
    p.add_argument("--vpp", type=positive_int("--vpp"), default=1,
                   help="virtual pipeline stages (model chunks) per pipeline rank of the conversion world")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--overwrite", action="store_true", help=CONVERT_OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.launch.convert import convert_to_megarl

        path = convert_to_megarl(None if a.src == "default" else a.src, a.out, tp=a.tp, pp=a.pp, vpp=a.vpp,
                                 dtype=a.dtype, overwrite=a.overwrite)
        print(f"wrote megarl checkpoint {path}")
        return 0
    return run


@command("export", help="megarl checkpoint -> Hugging Face directory")
def _export(p: argparse.ArgumentParser):
    p.add_argument("ckpt", help="megarl checkpoint directory (from `megarl convert` or `megarl train`)")
    p.add_argument("out", help="output Hugging Face directory")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.launch.convert import export_to_hf

        print(f"wrote Hugging Face checkpoint {export_to_hf(a.ckpt, a.out, overwrite=a.overwrite)}")
        return 0
    return run


@command("data", "gsm8k", help="prepare GSM8K (train/test parquet files)")
def _data_gsm8k(p: argparse.ArgumentParser):
    p.add_argument("--src", required=True,
                   help="directory with train.jsonl and test.jsonl, or a Hugging Face hub dataset id ('hub': "
                        "GSM8K's own, megarl.data.gsm8k.HF_REPO)")
    p.add_argument("--out", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.data.gsm8k import prepare_gsm8k

        return _print_written(prepare_gsm8k(a.src, a.out, overwrite=a.overwrite))
    return run


@command("data", "arithmetic", help="write the arithmetic task (train/test parquet files; the CPU main job's data)")
def _data_arithmetic(p: argparse.ArgumentParser):
    p.add_argument("--out", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.data.arithmetic import prepare_arithmetic

        return _print_written(prepare_arithmetic(a.out, overwrite=a.overwrite))
    return run


@command("data", "calculator", help="write the calculator task (5-digit sums for the calculator tool; train/test "
                                   "parquet files)")
def _data_calculator(p: argparse.ArgumentParser):
    p.add_argument("--out", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.data.arithmetic import prepare_calculator

        return _print_written(prepare_calculator(a.out, overwrite=a.overwrite))
    return run


def _print_written(written: dict) -> int:
    """``megarl data``'s report: one line per written split (its file and row count); exit status 0."""
    import pyarrow.parquet as pq

    for split, path in written.items():
        print(f"{split}: {path} ({pq.read_metadata(path).num_rows} problems)")
    return 0


@command("bench", "reshard", help="reshard benchmark against two baselines")
def _bench_reshard(p: argparse.ArgumentParser):
    from megarl.config import DTYPE_TABLE, MIN_BUCKET_MB, ReshardConfig

    short_dtypes = sorted(d.short for d in DTYPE_TABLE.values())  # bf16, fp16, fp32

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = """Reshard benchmark (megarl/bench/reshard.py), two modes:

  layout (default)  a model shape (--model, random weights) on a Megatron TP x PP x DP mesh of --nproc local
                    processes (gloo on CPU, NCCL on GPUs; or the ranks of torchrun/srun) is resharded into vLLM
                    TP shards (--dst vllm) or whole HF tensors (--dst hf) by the reshard engine and by two
                    baselines (gather the full model then slice; verl's per-tensor TP all-gather). Per rank:
                    bytes sent/received, peak extra memory, wall ms, destination GB/s, exact or not.
  micro             one process, no communication: the box-copy kernels of one rank's copies (the whole
                    model Megatron TP=1 -> vLLM TP=1 on one device; the pack and unpack of Megatron TP=1 ->
                    vLLM TP=t, t the smallest TP > 1 the model admits) against one plain device copy of the
                    same bytes and one torch copy_ per box.

The defaults run on any machine: SmolLM2-135M (9 heads, 3 KV heads) at Megatron TP=3 on 3 local ranks into
vLLM TP=1 engines, bf16, the trainer's bucket size (reshard.bucket_mb)."""
    dflt = ReshardConfig()
    p.add_argument("mode", nargs="?", choices=("layout", "micro"), default="layout",
                   help="what to measure (default: layout)")
    p.add_argument("--model", default="smollm2-135m", help="a named model shape (megarl.models.spec.PRESETS: "
                   "smollm2-135m, qwen2.5-0.5b, qwen2.5-7b, llama-3-8b, ...; default: smollm2-135m)")
    p.add_argument("--layers", type=int_at_least("--layers", 0), default=0,
                   help="cut the model to this many layers (default 0: all)")
    p.add_argument("--dtype", choices=short_dtypes, default="bf16", help="source dtype (default bf16)")
    p.add_argument("--iters", type=positive_int("--iters"), default=5, help="measured runs, median (default 5)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    g = p.add_argument_group("layout mode")
    g.add_argument("--nproc", type=positive_int("--nproc"), default=3,
                   help="local processes to spawn (default 3; ignored under torchrun or srun)")
    g.add_argument("--src-tp", type=positive_int("--src-tp"), default=3, help="Megatron TP of the source (default 3)")
    g.add_argument("--src-pp", type=positive_int("--src-pp"), default=1, help="Megatron PP of the source (default 1)")
    g.add_argument("--dst", choices=("vllm", "hf"), default="vllm",
                   help="vLLM TP shards or whole HF tensors (default vllm)")
    g.add_argument("--dst-tp", type=positive_int("--dst-tp"), default=1,
                   help="vLLM TP; its engines fill the world (default 1)")
    g.add_argument("--hf-ranks", type=int, nargs="+", default=[0],
                   help="ranks that get whole HF tensors, with --dst hf (default 0)")
    g.add_argument("--dst-dtype", choices=short_dtypes, default=None,
                   help="destination dtype (default: --dtype)")
    g.add_argument("--bucket-mb", type=positive_float("--bucket-mb", minimum=MIN_BUCKET_MB), default=dflt.bucket_mb,
                   help=f"staging bytes per rank per round, MiB, >= {MIN_BUCKET_MB:g} (default {dflt.bucket_mb:g}, "
                        "reshard.bucket_mb's)")
    g.add_argument("--ranks-per-node", type=positive_int("--ranks-per-node"), default=None,
                   help="for the same-node preference (default: one node)")
    g.add_argument("--no-direct", action="store_true", help=f"stage every piece (default: pieces of >= "
                   f"{dflt.direct_min_kb:g} KiB contiguous at an end go direct, reshard.direct_min_kb's)")
    g.add_argument("--warmup", type=int_at_least("--warmup", 0), default=1, help="unmeasured runs first (default 1)")
    g.add_argument("--no-baselines", dest="baselines", action="store_false", help="measure the reshard alone")
    g = p.add_argument_group("micro mode")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda where a GPU is, else cpu)")
    p.add_argument("--check", action="store_true", help="check the flags against the world and the model "
                   "(layout mode), print the result and run nothing")

    def run(a: argparse.Namespace) -> int:
        from megarl.bench.reshard import check_layout_args, run as bench_reshard

        a.direct_min_kb = None if a.no_direct else dflt.direct_min_kb
        if a.check:
            world = int(os.environ.get("WORLD_SIZE", a.nproc))
            if a.mode == "layout":
                check_layout_args(a, world)
            print(f"megarl bench reshard {a.mode}: check passed ({world} rank(s), model {a.model}); nothing was "
                  "run", flush=True)
            return 0
        return bench_reshard(a)
    return run


@command("bench", "step", help="RL steps phase by phase: time, tokens/s/GPU, MFU, peak memory, utilisation")
def _bench_step(p: argparse.ArgumentParser):
    p.add_argument("config", nargs="?", help="YAML file (parallel_configs/...); omitted: the CPU default")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=preset:qwen2.5-1.5b")
    p.add_argument("--steps", type=positive_int("--steps"), default=3, help="measured RL steps (default 3)")
    p.add_argument("--warmup", type=int_at_least("--warmup", 0), default=1,
                   help="RL steps run first and not measured (default 1)")
    p.add_argument("--json", default=None, help="report file (default: <run folder>/bench_step.json; the run "
                   "folder is runs/bench-<run.name> unless run.name is given on the command line)")
    p.add_argument("--peak-tflops", type=positive_float("--peak-tflops"), default=None,
                   help="peak TFLOP/s per GPU for MFU (default: the device's datasheet dense bf16 peak)")
    p.add_argument("--sample-interval", type=positive_float("--sample-interval"), default=0.1,
                   help="seconds between utilisation samples (default 0.1)")
    p.add_argument("--standalone-vllm", action="store_true",
                   help="then generate the measured batches on a plain vLLM on the same GPU and report the ratio "
                        "(rollout.engine=vllm)")
    p.add_argument("--standalone-repeats", type=positive_int("--standalone-repeats"), default=3,
                   help="timed passes of the standalone baseline over the batches; it reports the median and the "
                        "spread (default 3)")
    p.add_argument("--check", action="store_true", help=CHECK_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.config import load_config

        config, overrides = split_config_and_overrides(a.config, a.overrides)
        cfg = bench_step_config(config, overrides)
        if a.standalone_vllm and cfg.rollout.engine != "vllm":
            raise UsageError(f"bench step: --standalone-vllm compares with vLLM rollouts; rollout.engine is "
                             f"{cfg.rollout.engine!r}: set rollout.engine=vllm or drop the flag")
        if a.check:
            return check_only(cfg, "bench step")
        if relaunch_world(cfg, ["bench", *a.argv]):
            return 0
        from megarl.bench.step import bench_step

        report = bench_step(cfg, steps=a.steps, warmup=a.warmup, json_path=a.json, peak_tflops=a.peak_tflops,
                            sample_interval_s=a.sample_interval, standalone_vllm=a.standalone_vllm,
                            standalone_repeats=a.standalone_repeats, config_path=config, overrides=overrides)
        return 0 if report["status"] == "ok" else 1
    return run


@command("bench", "gate", help="compare a bench step report with the stored history of its case and GPU")
def _bench_gate(p: argparse.ArgumentParser):
    from megarl.bench.gate import add_arguments, run

    add_arguments(p)
    return run


@command("bench", "generation", help="where a vLLM rollout's generation time goes: per-token asks, engine steps, "
                                      "GPU busy vs idle")
def _bench_generation(p: argparse.ArgumentParser):
    p.add_argument("config", nargs="?", help="YAML file (parallel_configs/...); omitted: the CPU default")
    p.add_argument("overrides", nargs="*", help="dotted overrides: model.path, rollout.* (the engine and its vLLM "
                   "knobs), data.prompts_per_step, rollout.n, rollout.max_new_tokens (the batch)")
    p.add_argument("--label", default="engine", help="this engine configuration's name in the report")
    p.add_argument("--variants", default="megarl", help="comma-separated: megarl (the RL generate call), raw, "
                   "no_seeds, no_logprobs, no_stop, bare (megarl/bench/generation.py); the first is profiled "
                   "(default megarl)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=1,
                   help="timed calls per variant; the median is reported (default 1)")
    p.add_argument("--profile-tokens", type=int_at_least("--profile-tokens", 0), default=0,
                   help="profile the first variant on this many new tokens with the torch profiler (default 0: no)")
    p.add_argument("--json", default=None, help="report file")
    p.add_argument("--check", action="store_true", help="check the config against its model and print the "
                   "result; nothing is run")

    def run(a: argparse.Namespace) -> int:
        from megarl.bench.generation import VARIANTS, model_spec
        from megarl.config import load_config
        from megarl.trainer.preflight import validate_for_model

        config, overrides = split_config_and_overrides(a.config, a.overrides)
        cfg = load_config(config, overrides + ["validation.enabled=false"])
        variants = [v for v in a.variants.split(",") if v]
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants:
            raise UsageError(f"bench generation: --variants {a.variants!r}: choose from {','.join(VARIANTS)}")
        if cfg.rollout.engine != "vllm" or cfg.rollout.tp != 1:
            raise UsageError(f"bench generation measures one vLLM engine on one GPU: set rollout.engine=vllm and "
                             f"rollout.tp=1 (got {cfg.rollout.engine}, tp={cfg.rollout.tp})")
        spec = model_spec(cfg.model.path)
        validate_for_model(cfg, spec)
        if a.check:
            print(f"megarl bench generation: check passed (model {cfg.model.path}: {spec.num_layers} layers, hidden "
                  f"{spec.hidden_size}); nothing was run", flush=True)
            return 0
        from megarl.bench.generation import bench_generation

        bench_generation(cfg, label=a.label, variants=variants, repeats=a.repeats, profile_tokens=a.profile_tokens,
                         json_path=a.json)
        return 0
    return run


def bench_step_config(config: str | None, overrides: list[str]):
    """The config of ``megarl bench step``: no validation (it times steps), and a run folder of its own,
    ``bench-<run.name>``, unless ``run.name`` is given on the command line: a benchmark of the default config
    (or of a run's YAML) never writes into that training run's folder."""
    from megarl.config import load_config

    cfg = load_config(config, overrides + ["validation.enabled=false"])
    if not any(o.split("=", 1)[0].strip() == "run.name" for o in overrides):
        cfg.run.name = f"bench-{cfg.run.name}"
    return cfg


@command("submit", help="a training run as one SLURM batch job (sbatch)")
def _submit(p: argparse.ArgumentParser):
    from megarl.launch import submit

    submit.add_arguments(p)

    def run(a: argparse.Namespace) -> int:
        a.config, a.overrides = split_config_and_overrides(a.config, a.overrides)
        return submit.run(a)
    return run


@command("sweep", help="a config over a grid of values: one benchmark per point, table, CSV and plot")
def _sweep(p: argparse.ArgumentParser):
    from megarl.launch import sweep

    sweep.add_arguments(p)
    return sweep.run


# ------------------------------------------------------------------------------------------------ the tree
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``megarl`` argument tree (every registered :func:`command`). With ``argv``, only the command that it
    names gets its arguments: a builder imports what its command needs, so ``megarl --help`` and ``megarl
    COMMAND --help`` import neither torch nor megatron-core (each builder keeps its imports light)."""
    usage = __doc__.split("\n\n")[1]  # the table of commands at the top of this module's docstring
    root = _Parser(prog="megarl", description="megarl: RL post-training (PPO, GRPO and kin) of LLMs on "
                   "Megatron-core TP/PP/DP meshes, with vLLM rollouts.",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog=f"{usage}\n\n`megarl COMMAND --help` gives a command's flags; README.md walks "
                   "through a first run.")
    root_sub = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {(): root_sub}
    for path, help_text, build in _COMMANDS:
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in groups:
                g = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} subcommands")
                groups[prefix] = g.add_subparsers(dest=f"command_{depth}", metavar="SUBCOMMAND", required=True,
                                                  parser_class=_Parser)
        p = groups[path[:-1]].add_parser(path[-1], help=help_text, description=help_text)
        if argv is None or list(path) == argv[:len(path)]:
            p.set_defaults(run=build(p))
    return root


def main(argv: list[str] | None = None) -> int:
    from megarl.parallel.lifecycle import bind_to_launcher, watch_interrupts

    bind_to_launcher()  # a rank (torchrun relaunch, torchrun, srun) ends with the process that started it
    watch_interrupts()
    if is_rank():
        from megarl.parallel.restart import watch_requeue_signal

        watch_requeue_signal()  # SIGUSR1 (SLURM, before the time limit): save after the step, then requeue
        import faulthandler

        faulthandler.enable()  # a rank that crashes in native code (SIGSEGV, SIGABRT) prints its Python stacks
    argv = list(sys.argv[1:] if argv is None else argv)
    from megarl.config import ConfigError
    from megarl.parallel.lifecycle import PeerLostError, interrupted
    from megarl.parallel.restart import EXIT_REQUEUE, EXIT_STORAGE, RequeueRequested
    from megarl.storage import StorageError, is_storage_fault
    from megarl.trainer.run_lock import RunLockedError

    try:
        parser = build_parser(argv)
        if not argv:
            parser.print_help()
            return 0
        args, extra = parser.parse_known_args(argv)
        if extra and isinstance(getattr(args, "overrides", None), list) and all(
                "=" in e and not e.startswith("-") for e in extra):
            args.overrides += extra  # overrides after a flag: `megarl train CONFIG --resume trainer.steps=N`
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        run = getattr(args, "run", None)
        if run is None:
            parser.print_help()
            return 0
        del args.run  # a command's namespace holds its flags alone, picklable (bench reshard sends it to its ranks)
        args.argv = argv[1:]
        from megarl.console import quiet_libraries, quiet_other_ranks
        from megarl.parallel.lifecycle import own_descendants

        own_descendants()  # what the command starts (libraries' helpers included) ends with it, kill -9 included
        quiet_libraries()
        if is_rank():
            quiet_other_ranks()
        return run(args)
    except (UsageError, ConfigError, ValueError, FileNotFoundError, RunLockedError) as e:  # errors naming the fix
        if os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e}", file=sys.stderr)  # every rank of a job says it: a rank that stayed silent
        return 2  # could be the one its launcher leaves standing, and the message would be lost
    except OSError as e:  # a full disk, a read-only folder, a file where a folder must be: one line, not retried
        if not is_storage_fault(e) or os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e if isinstance(e, StorageError) else _storage_line(e)}", file=sys.stderr, flush=True)
        return EXIT_STORAGE
    except (Interrupted, KeyboardInterrupt) as e:  # the user's Ctrl-C: no traceback, and how to go on
        return _interrupted(e)
    except RequeueRequested as e:  # SIGUSR1: saved; the job's supervisor requeues it
        from megarl.parallel.lifecycle import started_by_megarl

        if not (is_rank() and (started_by_megarl() or _rank() != 0)):  # one line: megarl's launcher's, or rank 0's
            print(f"megarl: {e}", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except PeerLostError as e:  # one rank's view of a failed job: what it lost, and where
        if interrupted():  # the peer stopped on the same Ctrl-C
            return _interrupted(e)
        if os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e}", file=sys.stderr, flush=True)
        return 1


def _storage_line(e: OSError) -> str:
    """The message of a storage fault that megarl's code did not describe itself (:mod:`megarl.storage`)."""
    from megarl.storage import describe

    return (f"cannot write: {describe(e)}; free space or fix the folder, then run again (a training run continues "
            "from its newest checkpoint with --resume)")


def _interrupted(e: BaseException) -> int:
    """The exit of a command the user stopped: one line saying how to go on (from megarl's launcher alone
    when this is one of its ranks), status 130 (128 + SIGINT, as a shell reports it)."""
    from megarl.parallel.lifecycle import started_by_megarl

    if not started_by_megarl():
        print(f"megarl: interrupted{'; ' + str(e) if isinstance(e, Interrupted) else ''}", file=sys.stderr,
              flush=True)
    return 130


def end_process(status: int) -> NoReturn:
    """End a finished megarl process: destroy its process groups while the interpreter is whole, end every
    process it started (:func:`megarl.parallel.lifecycle.end_descendants`), flush its output, and leave with
    ``os._exit`` as :mod:`multiprocessing` ends its children, without interpreter teardown. Afterwards nothing
    holds its stdout or stderr: ``megarl train ... | cat`` ends with the run.

    Teardown destroys C++ objects of torch and gloo whose worker threads may still hold Python objects; on a
    loaded machine that aborted a finished rank now and then (``terminate called without an active
    exception``, exit code -6) after its work was done and written; and the helpers that libraries start and
    never stop (megatron-core's checkpoint writer's ``multiprocessing`` manager and its resource tracker) kept
    running after it, holding the output open. Everything megarl writes is closed before this (loggers,
    checkpoints, reports)."""
    import logging

    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    from megarl.parallel.lifecycle import end_descendants

    end_descendants()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that has gone (``| head``), a closed stream
            pass
    os._exit(status)


def entry() -> NoReturn:
    """The ``megarl`` command and ``python -m megarl.cli``: :func:`main`, then :func:`end_process` with its
    status; a crash (an exception that :func:`main` does not turn into a message) prints its traceback and ends
    with status 1, never 0."""
    try:
        status = main()
    except SystemExit as e:  # a status chosen on the way (relaunch_world's for its ranks' failure)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 (a crash: said in full, and a failed status whatever teardown does)
        import traceback

        traceback.print_exc()
        status = 1
    end_process(status)


if __name__ == "__main__":
    entry()
