"""Standalone vLLM on the batches an RL run generated: the ceiling of its generation phase.

``megarl bench step --standalone-vllm`` records every ``generate`` call of the measured steps on rank 0 (prompt
token ids, samples per prompt, sampling, the length of every response) with :class:`GenerateRecorder`, frees
the trainer, and runs this module in a child process on the same GPU::

    python -m megarl.bench.vllm_standalone REQUEST.json RESULT.json

The child builds the rollout engine itself (:class:`~megarl.rollout.vllm_engine.VLLMRolloutEngine` on a world of
one rank, with the RL engine's TP-1 settings: the same ``vllm.LLM`` arguments, :func:`~megarl.rollout.vllm_engine.
llm_kwargs`, sleep mode and external launcher included, the same :class:`~megarl.rollout.vllm_engine.VLLMSettings`,
dtype, ``enforce_eager``, ``gpu_memory_utilization``, ``max_model_len`` and block-FP8 weights where the run had
them), and generates the recorded calls again on its dummy weights, without sleeping or weight updates: one
request per sample as the rollout engine sends them (seeded when the run seeds them, the sampled token's
log-prob asked for where the engine reads vLLM's output, taken by its capture where it reads the sampler's),
each forced to the recorded length (``max_tokens = length``, ``ignore_eos``, no stop ids; no ``min_tokens``,
whose logits processor the RL requests do not pay), so that both decode the same tokens.
The prefix cache is dropped before each call, as the rollout engine does at every wake-up.

Measurement: one untimed pass over every recorded call (warm-up: lazily built kernels and graphs; after a
warm-up of the first call alone, the first timed pass of the 1.5B case ran at 19.3k tokens/s and the next two at
43.3k and 39.5k on the H200, 2026-12-03), then ``repeats`` timed passes over all recorded calls (garbage collected before each call); the result is the median
pass, with every pass's rate and the spread ``(max - min) / median``. The ratio RL / standalone is reported by
``bench step``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence


class GenerateRecorder:
    """Wraps a rollout engine; while ``recording`` is True, keeps each ``generate`` call's prompts, samples per
    prompt, sampling and response lengths (``recorded``), and the call's seconds. Everything else is the
    engine's."""

    _OWN = ("engine", "recording", "recorded")

    def __init__(self, engine):
        self.engine = engine
        self.recording = False
        self.recorded: list[dict[str, Any]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __setattr__(self, name, value):  # e.g. the trainer restoring the engine's call counter
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.engine, name, value)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling, **kwargs):
        out = self.engine.generate(prompt_token_ids, sampling, **kwargs)
        if self.recording:
            self.recorded.append({"prompts": [list(map(int, p)) for p in prompt_token_ids], "n": sampling.n,
                                  "temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "top_k": sampling.top_k, "lengths": [len(s.token_ids) for s in out.samples],
                                  "seconds": out.stats.seconds})
        return out


def run_standalone(request: dict[str, Any]) -> dict[str, Any]:
    """Generate the recorded calls of ``request`` on a one-rank rollout engine (see the module docstring).

    Args:
        request: ``{"model_dir": a directory with the engine's config.json, "engine": {enforce_eager,
            gpu_memory_utilization, max_model_len, seed, settings (VLLMSettings fields)}, "calls":
            [GenerateRecorder.recorded entries], "repeats": timed passes (default 3)}``.

    Returns:
        ``{"status": "ok", "init_s", "tokens" (a pass), "seconds" (the median pass), "tokens_per_s" (its rate),
        "tokens_per_s_runs" (every pass), "spread" ((max - min) / median rate), "repeats", "per_call": [{tokens,
        seconds}] (the median pass)}``.

    Raises:
        ImportError: vllm is not installed. ValueError: no recorded call, or repeats < 1.
    """
    from types import SimpleNamespace

    from megarl.models.spec import ModelSpec
    from megarl.parallel.mesh import init_distributed
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings

    repeats = int(request.get("repeats", 3))
    if not request["calls"]:
        raise ValueError("no generate call was recorded")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    e = request["engine"]
    settings = VLLMSettings.from_config(SimpleNamespace(**e["settings"]))
    spec = ModelSpec.from_hf_config(json.loads((Path(request["model_dir"]) / "config.json").read_text()))
    start = time.perf_counter()
    init_distributed()  # a world of this one process (no torchrun variables: see bench step's child env)
    engine = VLLMRolloutEngine(spec, tp=1, gpu_memory_utilization=e["gpu_memory_utilization"],
                               enforce_eager=e["enforce_eager"], max_model_len=e["max_model_len"], seed=e["seed"],
                               settings=settings)
    init_s = time.perf_counter() - start
    from vllm import SamplingParams, TokensPrompt

    asked = 0 if engine.logprobs_source == "output" else None  # the sampler's: the engine's capture takes them

    def requests(call):
        rows = [(k, j) for k in range(len(call["prompts"])) for j in range(call["n"])]
        prompts = [TokensPrompt(prompt_token_ids=call["prompts"][k]) for k, _ in rows]
        params = [SamplingParams(n=1, temperature=call["temperature"], top_p=call["top_p"],
                                 top_k=0 if call["top_k"] == -1 else call["top_k"], max_tokens=length,
                                 ignore_eos=True, seed=i if settings.request_seeds else None, logprobs=asked,
                                 detokenize=False)
                  for i, length in enumerate(call["lengths"])]
        return prompts, params

    def timed(call) -> dict[str, float]:
        engine.llm.reset_prefix_cache()  # as the rollout engine at every wake-up
        gc.collect()
        prompts, params = requests(call)
        t = time.perf_counter()
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": time.perf_counter() - t}

    for call in request["calls"]:  # warm-up pass
        timed(call)
    passes = [[timed(call) for call in request["calls"]] for _ in range(repeats)]
    rates = [sum(c["tokens"] for c in p) / sum(c["seconds"] for c in p) for p in passes]
    median = sorted(range(repeats), key=lambda i: rates[i])[repeats // 2]
    tokens, seconds = (sum(c[k] for c in passes[median]) for k in ("tokens", "seconds"))
    return {"status": "ok", "init_s": init_s, "tokens": tokens, "seconds": seconds, "tokens_per_s": rates[median],
            "tokens_per_s_runs": rates, "spread": (max(rates) - min(rates)) / rates[median], "repeats": repeats,
            "per_call": passes[median]}


def main(argv: list[str] | None = None) -> int:
    """``python -m megarl.bench.vllm_standalone REQUEST.json RESULT.json``; the result holds status "error" and
    the message when generation fails."""
    request_path, result_path = argv if argv is not None else sys.argv[1:3]
    try:
        result = run_standalone(json.loads(Path(request_path).read_text()))
    except Exception as e:  # reported in the bench step's JSON rather than lost in a child's stderr
        result = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    Path(result_path).write_text(json.dumps(result, indent=2))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
