"""``megarl train``, ``megarl eval`` and ``megarl report``: a run, the evaluation of its checkpoints (or of any
model) and the report of its metrics."""

from __future__ import annotations

import argparse
import os
import sys

from megarl.cli.args import CHECK_HELP, Interrupted, UsageError, command, int_at_least, split_config_and_overrides
from megarl.cli.world import check_only, is_rank, relaunch_world


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
        from megarl.offline.evaluate import evaluate_model

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
    p.add_argument("--overwrite", action="store_true", help="replace the report (report.md and report/) when the "
                   "run or an earlier megarl report wrote one. Default: refuse")

    def run(a: argparse.Namespace) -> int:
        try:
            from megarl.trainer.report import write_report
        except ImportError as e:
            raise UsageError(f"megarl report needs matplotlib ({e}): pip install 'megarl[report]'") from None
        print(f"wrote {write_report(a.run_dir, overwrite=a.overwrite)}")
        return 0
    return run
