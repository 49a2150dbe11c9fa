"""``megarl eval MODEL_OR_CHECKPOINT [CONFIG] [key=value ...]``: a run's validation (:mod:`.validation`) on a
model outside a run.

The model is a Hugging Face directory, a GGUF file, ``default`` (the SmolLM2-135M-Instruct GGUF) or a megarl
checkpoint (``runs/<name>/checkpoints/step_000004``); the config's ``validation`` section says which prompts
(``validation.num_prompts=0``: the whole split) and how to decode them, ``rollout.engine`` which engine
(transformers on the CPU, vLLM on the GPU) and ``reward.fn`` how to score. Launched plainly it runs in one
process; under ``torchrun --nproc_per_node=N`` the prompts are split over the N ranks (one engine each).

Writes ``eval.json`` (the figures, the model, what was evaluated) and ``eval_samples.jsonl`` (one record per
response: prompt, response, ground truth, score, length, finish reason) into the output folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megarl.config import Config
from megarl.models import checkpoint as ck
from megarl.models.hf_io import load_tokenizer, open_hf_checkpoint
from megarl.models.weights import fill_local_tensors
from megarl.parallel.mesh import init_distributed
from megarl.rewards.registry import load_reward_fn
from megarl.rollout.base import RolloutEngine, WriteFn, state_dict_writer
from megarl.rollout.data_parallel import rollout_dp_group
from megarl.trainer.preflight import check_files, tokenizer_source
from megarl.trainer.trainer import load_validation, make_engine, resolve_eos
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
        ``{"model", "prompts" (a description), "metrics"}``, also written to ``<out_dir>/eval.json`` by rank 0
        with the samples in ``<out_dir>/eval_samples.jsonl``.

    Raises:
        ConfigError: a missing data file that cannot be prepared, a model without a tokenizer (a preset without
            ``model.tokenizer``), or a bad rollout setting.
        FileNotFoundError: the model does not exist.
    """
    source = None if cfg.model.path == "default" else cfg.model.path
    spec, _, model_tokenizer = ck.source_spec(source)  # a bad path or data fail before any process group
    check_files(cfg, "validation.files", cfg.validation.files)
    tokenizer = load_tokenizer(tokenizer_source(cfg, model_tokenizer))
    init_distributed()
    spec = resolve_eos(spec, tokenizer, cfg.model.path, ck.source_generation_config(source))
    validation = load_validation(cfg, tokenizer, score_data_parallel(load_reward_fn(cfg.reward.fn, cfg.reward.kwargs)),
                                 spec)
    engine = make_engine(cfg, spec)
    engine.update_weights(weights_writer(source, engine))
    metrics, records = validation.run(engine, group=rollout_dp_group(cfg.rollout.tp if cfg.rollout.engine == "vllm"
                                                                     else 1))
    result = {"model": cfg.model.path if cfg.model.path == "default" else str(Path(cfg.model.path).resolve()),
              "prompts": validation.describe(), "metrics": metrics,
              "reward": cfg.reward.fn, "engine": cfg.rollout.engine}
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(result, indent=2))
        (out / "eval_samples.jsonl").unlink(missing_ok=True)
        append_samples(out / "eval_samples.jsonl", records)
    return result
