"""``megarl bench reshard|step|gate|generation``: the benchmarks (:mod:`megarl.bench`)."""

from __future__ import annotations

import argparse
import os

from megarl.cli.args import (CHECK_HELP, FILE_OVERWRITE_HELP, UsageError, command, int_at_least, positive_float,
                             positive_int, split_config_and_overrides)
from megarl.cli.world import check_only, relaunch_world
from megarl.output_folder import claim_outputs


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
    p.add_argument("--overwrite", action="store_true", help=FILE_OVERWRITE_HELP)
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
        claim_outputs([a.json] if a.json else [], "bench reshard", overwrite=a.overwrite,
                      alternative=", or give another --json")
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
    p.add_argument("--overwrite", action="store_true", help=FILE_OVERWRITE_HELP)
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
        config, overrides = split_config_and_overrides(a.config, a.overrides)
        cfg = bench_step_config(config, overrides)
        if a.standalone_vllm and cfg.rollout.engine != "vllm":
            raise UsageError(f"bench step: --standalone-vllm compares with vLLM rollouts; rollout.engine is "
                             f"{cfg.rollout.engine!r}: set rollout.engine=vllm or drop the flag")
        json_path = a.json or cfg.run.run_dir / "bench_step.json"
        claim_outputs([json_path], "bench step", overwrite=a.overwrite, alternative=", or give another --json")
        if a.check:
            return check_only(cfg, "bench step")
        if relaunch_world(cfg, ["bench", *a.argv]):
            return 0
        from megarl.bench.step import bench_step

        report = bench_step(cfg, steps=a.steps, warmup=a.warmup, json_path=json_path, peak_tflops=a.peak_tflops,
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
    p.add_argument("--overwrite", action="store_true", help=FILE_OVERWRITE_HELP)
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
        claim_outputs([a.json] if a.json else [], "bench generation", overwrite=a.overwrite,
                      alternative=", or give another --json")
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
