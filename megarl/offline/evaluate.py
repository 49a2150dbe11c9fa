"""``megarl eval MODEL_OR_CHECKPOINT [CONFIG] [key=value ...]``: a run's validation (:mod:`.validation`) on a
model outside a run.

The model is a Hugging Face directory, a GGUF file, ``default`` (the SmolLM2-135M-Instruct GGUF) or a megarl
checkpoint (``runs/<name>/checkpoints/step_000004``); the config's ``validation`` section says which prompts
(``validation.num_prompts=0``: the whole split) and how to decode them, ``rollout.engine`` which engine
(transformers on the CPU, vLLM on the GPU) and ``reward.fn`` how to score. Launched plainly it runs in one
process; under ``torchrun --nproc_per_node=N`` the prompts are split over the N ranks (one engine each).

Writes ``eval.json`` (the figures, the model, what was evaluated) and ``eval_samples.jsonl`` (one record per
response: prompt, response, ground truth, score, length, finish reason) into the output folder; a later
evaluation into the same folder writes ``eval-2.json`` and ``eval_samples-2.jsonl`` (then ``-3``, ...), so no
result is replaced. Rank 0 says what it does as it goes (the model, the prompts, the generation's time every
30 s), since a CPU evaluation runs for minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megarl.config import Config
from megarl.models import checkpoint as ck
from megarl.models.hf_io import load_tokenizer, open_hf_checkpoint
from megarl.models.weights import fill_local_tensors
from megarl.parallel.mesh import init_distributed
from megarl.rewards.mix import StepReward
from megarl.rollout.base import RolloutEngine, WriteFn, state_dict_writer
from megarl.rollout.data_parallel import rollout_dp_group
from megarl.trainer.preflight import check_files, check_reward, tokenizer_source
from megarl.trainer.builders import load_validation, make_engine, resolve_eos
from megarl.trainer.validation import append_samples, score_data_parallel


def weights_writer(source: str | None, engine: RolloutEngine) -> WriteFn:
    """A ``write`` for ``engine.update_weights`` that fills this rank's engine tensors from ``source`` (an HF
    directory or GGUF, read slice by slice; a megarl checkpoint, assembled whole by :func:`load_canonical`).

    Raises:
        SpecError: the checkpoint lacks a tensor of the model or has another shape.
    """
    rank, layout = dist.get_rank(), engine.weight_layout(range(dist.get_world_size()))
    if source is not None and ck.is_megarl_checkpoint(source):
        from megarl.models.convert import load_canonical

        return state_dict_writer(load_canonical(source), layout, rank)
    ckpt = open_hf_checkpoint(source)
    ckpt.check_complete()
    return lambda tensors: fill_local_tensors(layout.tensors(rank), tensors, ckpt.read)


def evaluate_model(cfg: Config, out_dir: str | Path) -> dict[str, Any]:
    """Evaluate ``cfg.model.path`` on the validation prompts of ``cfg`` (call on every rank).

    Returns:
        ``{"model", "prompts" (a description), "metrics", "reward", "engine"}``, also written by rank 0 to
        ``<out_dir>/eval.json`` with the samples in ``<out_dir>/eval_samples.jsonl`` (or the next free
        ``eval-<k>`` pair, :func:`result_files`), whose paths rank 0's result adds as ``"files"``.

    Raises:
        ConfigError: a missing data file that cannot be prepared, a model without a tokenizer (a preset without
            ``model.tokenizer``), a bad rollout setting, or a bad reward (:func:`~megarl.trainer.preflight.
            check_reward`).
        FileNotFoundError: the model does not exist.
    """
    source = None if cfg.model.path == "default" else cfg.model.path
    spec, _, model_tokenizer = ck.source_spec(source)  # a bad path or data fail before any process group
    check_files(cfg, "validation.files", cfg.validation.files)
    check_reward(cfg)  # a reward model's damaged weight file, before any process group
    _say(f"loading {cfg.model.path} and its tokenizer")
    tokenizer = load_tokenizer(tokenizer_source(cfg, model_tokenizer))
    init_distributed()
    spec = resolve_eos(spec, tokenizer, cfg.model.path, ck.source_generation_config(source))
    validation = load_validation(cfg, tokenizer, score_data_parallel(StepReward(cfg.reward)),
                                 spec)
    engine = make_engine(cfg, spec)
    engine.update_weights(weights_writer(source, engine))
    _say(f"generating {validation.describe()} on {dist.get_world_size()} rank(s) ({cfg.rollout.engine} engine)")
    with _heartbeat("generating", every_s=30.0):
        metrics, records = validation.run(engine, group=rollout_dp_group(cfg.rollout.tp if cfg.rollout.engine == "vllm"
                                                                         else 1))
    result = {"model": cfg.model.path if cfg.model.path == "default" else str(Path(cfg.model.path).resolve()),
              "prompts": validation.describe(), "metrics": metrics,
              "reward": cfg.reward.fn, "engine": cfg.rollout.engine}
    if dist.get_rank() == 0:
        json_path, samples_path = result_files(out_dir)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
        append_samples(samples_path, records)
        result = {**result, "files": [str(json_path), str(samples_path)]}
    return result


def result_files(out_dir: str | Path) -> tuple[Path, Path]:
    """The first free pair of ``eval.json`` / ``eval_samples.jsonl``, ``eval-2.json`` / ``eval_samples-2.jsonl``,
    ... in ``out_dir``: an evaluation never replaces an earlier one's results."""
    out = Path(out_dir)
    k = 1
    while (out / f"eval{_suffix(k)}.json").exists() or (out / f"eval_samples{_suffix(k)}.jsonl").exists():
        k += 1
    return out / f"eval{_suffix(k)}.json", out / f"eval_samples{_suffix(k)}.jsonl"


def _suffix(k: int) -> str:
    return "" if k == 1 else f"-{k}"


def _say(message: str) -> None:
    """Print a progress line from rank 0 (or a launcher that is no rank)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"megarl eval: {message}", flush=True)


@contextlib.contextmanager
def _heartbeat(what: str, every_s: float):
    """Say ``what`` and the seconds it has taken every ``every_s`` seconds while the block runs, then its time."""
    start, done = time.perf_counter(), threading.Event()

    def beat():
        while not done.wait(every_s):
            _say(f"{what}: {time.perf_counter() - start:.0f} s")

    thread = threading.Thread(target=beat, name="megarl-eval-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    _say(f"{what} took {time.perf_counter() - start:.0f} s")
