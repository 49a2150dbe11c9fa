"""Standalone vLLM on the batches an RL run generated: the ceiling of its generation phase.

``megarl bench step --standalone-vllm`` records every ``generate`` call of the measured steps on rank 0 (prompt
token ids, samples per prompt, sampling, the length of every response) with :class:`GenerateRecorder`, frees
the trainer, and runs this module in a child process on the same GPU::

    python -m megarl.bench.vllm_standalone REQUEST.json RESULT.json

The child starts a plain ``vllm.LLM`` (no sleep mode, no external launcher, no weight updates) on the same
model shape with dummy weights, the same dtype (bf16), ``enforce_eager``, ``gpu_memory_utilization`` and
``max_model_len``, and the same in-process engine core (:data:`megarl.rollout.vllm_engine.VLLM_ENV`). It
generates every recorded call again: one seeded request per sample, as the rollout engine sends them, each
forced to the recorded response length (``min_tokens = max_tokens = length``, ``ignore_eos``) so that both
runs decode exactly the same number of tokens per request, with the sampled token's log-prob as in RL. The
first call is run once untimed (warm-up). The ratio RL / standalone is reported by ``bench step``.
"""

from __future__ import annotations

import json
import os
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
    """Generate the recorded calls of ``request`` on a plain ``vllm.LLM`` (see the module docstring).

    Args:
        request: ``{"model_dir": a directory with the model's config.json, "engine": {enforce_eager,
            gpu_memory_utilization, max_model_len, seed}, "calls": [GenerateRecorder.recorded entries]}``.

    Returns:
        ``{"status": "ok", "init_s", "tokens", "seconds", "tokens_per_s", "per_call": [{tokens, seconds}]}``.

    Raises:
        ImportError: vllm is not installed. ValueError: no recorded call.
    """
    from megarl.rollout.vllm_engine import VLLM_ENV

    if not request["calls"]:
        raise ValueError("no generate call was recorded")
    os.environ.update(VLLM_ENV)
    import vllm
    from vllm import SamplingParams, TokensPrompt

    e = request["engine"]
    start = time.perf_counter()
    llm = vllm.LLM(model=request["model_dir"], skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                   enforce_eager=e["enforce_eager"], gpu_memory_utilization=e["gpu_memory_utilization"],
                   max_model_len=e["max_model_len"], seed=e["seed"], logprobs_mode="processed_logprobs")
    init_s = time.perf_counter() - start

    def requests(call):
        rows = [(k, j) for k in range(len(call["prompts"])) for j in range(call["n"])]
        prompts = [TokensPrompt(prompt_token_ids=call["prompts"][k]) for k, _ in rows]
        params = [SamplingParams(n=1, temperature=call["temperature"], top_p=call["top_p"],
                                 top_k=0 if call["top_k"] == -1 else call["top_k"], max_tokens=length,
                                 min_tokens=length, ignore_eos=True, seed=i, logprobs=0, detokenize=False)
                  for i, length in enumerate(call["lengths"])]
        return prompts, params

    llm.generate(*requests(request["calls"][0]), use_tqdm=False)  # warm-up
    per_call = []
    for call in request["calls"]:
        prompts, params = requests(call)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        per_call.append({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds})
    tokens, seconds = sum(c["tokens"] for c in per_call), sum(c["seconds"] for c in per_call)
    return {"status": "ok", "init_s": init_s, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "per_call": per_call}


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
