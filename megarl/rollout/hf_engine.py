"""The transformers rollout engine: the CPU default and the reference the GPU engines are checked against.

The Hugging Face model (``AutoModelForCausalLM.from_config(spec.to_hf_config())``, float32, eval mode) is
built once from the :class:`~megarl.models.spec.ModelSpec`; its weights arrive only through
:meth:`HFRolloutEngine.update_weights`, as whole canonical (HF) tensors
(:func:`megarl.models.layout.hf_layout`). Generation is a decode loop around the model's forward with a KV
cache (``DynamicCache``): prompts are left-padded into micro-batches of at most ``max_batch_size`` rows (one
row per sample, rows sorted by prompt length to limit padding), each distinct prompt of a micro-batch prefilled
once in one forward (its KV-cache rows then copied to each of its samples), then decoded one token per forward;
a row that samples an EOS/stop token or reaches its length limit leaves the batch (its KV-cache rows are
dropped). :meth:`HFRolloutEngine.generate_stream` runs that loop one forward a ``next``, yielding the samples as they
finish (what :mod:`megarl.rollout.overlap` drives; ``generate`` drains it). Token selection and log-prob semantics:
:mod:`megarl.rollout.sampler`. An MoE
model's samples carry the top-k experts each token was routed to (:attr:`~megarl.rollout.base.Sample.
routed_experts`, recorded by :class:`~megarl.models.router_replay.EngineRouteRecorder` during prefill and decode).

Request by request (:class:`~megarl.rollout.base.RequestEngine`, multi-turn episodes): :meth:`HFRolloutEngine.
add_request` queues a request and :meth:`HFRolloutEngine.step` generates every request queued since the last
step as micro-batches of the decode loop above (requests of other sampling settings in batches of their own),
so a request added while a step runs (an episode whose tool answered meanwhile) waits for the next step only,
never for the other episodes' tools. No KV cache is kept between requests (every turn prefills its prompt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterable, Iterator, Sequence

import torch

from megarl.models.layout import Layout, hf_layout, local_views
from megarl.models.router_replay import EngineRouteRecorder
from megarl.models.spec import ModelSpec, SpecError
from megarl.rollout.base import (
    Completion,
    RolloutError,
    RolloutOutput,
    Sample,
    SamplingConfig,
    WriteFn,
    check_prompts,
    check_ready,
    sample_rows,
    sample_seed,
)
from megarl.rollout.sampler import sample_tokens


class HFRolloutEngine:
    """A :class:`~megarl.rollout.base.RolloutEngine` running the transformers model on CPU in float32.

    Args:
        spec: the model.
        max_batch_size: rows (samples) per micro-batch, >= 1; bounds the KV cache at
            ``2 * num_layers * max_batch_size * context * num_kv_heads * head_dim`` floats.

    Attributes:
        spec: the model.
        model: the transformers model (its parameters are the engine's weights, written in place).
        calls: ``generate`` calls so far; part of every sample's seed, so a resumed run restores it.
        adapter_version: the LoRA adapters' version merged into its weights (None without LoRA), stamped on every
            sample.
        policy_version: the version of the policy weights it holds (None until set), stamped on every sample and
            completion.

    Raises:
        RolloutError: ``max_batch_size < 1``.
        SpecError: the transformers model's parameter names or shapes differ from the canonical tensors of
            ``spec`` (the layout would not match the engine).
    """

    def __init__(self, spec: ModelSpec, *, max_batch_size: int = 32):
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise RolloutError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        layout = hf_layout(spec, [0], fused_experts=True).tensors(0)  # fused experts: their 2-D views
        params = {n: tuple(p.shape) for n, p in local_views(self._weights(), layout).items()}
        layout = {n: t.shape for n, t in layout.items()}
        if params != layout:
            diff = sorted(set(params.items()) ^ set(layout.items()))
            raise SpecError(f"the transformers model's parameters differ from the canonical tensors of the spec "
                            f"(name, shape) in one but not the other: {diff[:6]}")
        self._shapes = {n: p.shape for n, p in self.model.named_parameters()}
        self._routes = EngineRouteRecorder(self.model, spec) if spec.is_moe else None
        self.calls = 0
        self.adapter_version: int | None = None
        self.policy_version: int | None = None
        self._has_weights = False
        self._asleep = False
        self._queued: list[tuple[str, list[int], SamplingConfig, int]] = []  # add_request's, for step

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (what ``update_weights`` hands to ``write``): float32."""
        return torch.float32

    # ------------------------------------------------------------------ weights and memory
    def _weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters and the buffers that are canonical tensors too (DeepSeek-V3's router
        ``e_score_correction_bias``, a buffer in transformers)."""
        canonical = self.spec.hf_tensor_shapes()
        return {**dict(self.model.named_parameters()),
                **{n: b for n, b in self.model.named_buffers() if n in canonical}}

    def weight_layout(self, ranks: Iterable[int]) -> Layout:
        """Whole canonical tensors under their HF names on every rank (:func:`~megarl.models.layout.hf_layout`);
        with tied embeddings there is no ``lm_head.weight``; MoE experts as transformers fuses them in memory."""
        return hf_layout(self.spec, ranks, fused_experts=True)

    def update_weights(self, write: WriteFn) -> Any:
        """Call ``write({name: parameter})`` on the model's own parameters (float32, CPU), written in place.

        Returns:
            What ``write`` returns (e.g. the reshard executor's stats).

        Raises:
            RolloutError: the engine is asleep (call :meth:`wake_up` first).
        """
        if self._asleep:
            raise RolloutError("update_weights on a sleeping engine: call wake_up() first")
        params = {n: p.detach() for n, p in self._weights().items()}
        result = write(local_views(params, self.weight_layout([0]).tensors(0)))
        self._has_weights = True
        return result

    def sleep(self, level: int = 1) -> None:
        """Give memory back between rollout phases.

        Level 1 frees nothing here: the KV cache lives only inside :meth:`generate` and the weights stay (on
        CPU there is no faster memory to offload them from). Level 2 also frees the weights (every parameter
        becomes an empty tensor); they must be written again by :meth:`update_weights` after :meth:`wake_up`.

        Raises:
            RolloutError: a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise RolloutError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level}")
        if level == 2:
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype)
            self._has_weights = False
        self._asleep = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: after a level-2 sleep, parameters get (uninitialised) storage back."""
        if self._asleep:
            for name, p in self.model.named_parameters():
                if p.numel() == 0:
                    p.data = torch.empty(self._shapes[name], dtype=p.dtype)
        self._asleep = False

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_offset: int = 0) -> RolloutOutput:
        """Sample ``sampling.n`` responses per prompt (see :meth:`~megarl.rollout.base.RolloutEngine.generate`).

        A response ends at the first token of ``spec.eos_token_ids`` or ``sampling.stop_token_ids``
        (finish "stop", the token kept), or after ``min(max_new_tokens, context - prompt length)`` tokens
        (finish "length"). Samples are seeded by :func:`~megarl.rollout.base.sample_seed` with this engine's
        call counter, so results do not depend on ``max_batch_size`` or on how prompts are split into
        ``prompt_offset`` shards (up to float rounding of the logits between batch shapes).

        Returns:
            Prompt-major samples: ``samples[k * n + j]`` is sample ``j`` of prompt ``prompt_offset + k``.

        Raises:
            RolloutError: a bad prompt (:func:`~megarl.rollout.base.check_prompts`), a sleeping engine, or
                no weights loaded yet (:meth:`update_weights`).
        """
        start = time.perf_counter()
        samples = [s for done in self.generate_stream(prompt_token_ids, sampling, prompt_offset=prompt_offset)
                   for s in done]
        samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        prompts = [list(p) for p in prompt_token_ids]
        return RolloutOutput.collect(samples, sampling.n, prompts, time.perf_counter() - start)

    def generate_stream(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                        prompt_offset: int = 0) -> Iterator[list[Sample]]:
        """:meth:`generate` one decode step at a time: each ``next`` runs one forward of the decode loop (the
        prefill or one token of the micro-batch in progress) and yields the samples that finished in it (often
        ``[]``); every sample comes once, the same as :meth:`generate`'s (which drains this). What the rollout's
        overlap with scoring (:mod:`megarl.rollout.overlap`) drives.

        Raises:
            RolloutError: as :meth:`generate`, at the first ``next``.
        """
        check_ready(self._asleep, self._has_weights)
        prompts = check_prompts(prompt_token_ids, max_context=self.spec.max_position_embeddings,
                                vocab_size=self.spec.vocab_size)
        call = self.calls
        self.calls += 1
        rows = sample_rows(len(prompts), sampling.n)
        by_length = sorted(range(len(rows)), key=lambda r: len(prompts[rows[r][0]]))
        for lo in range(0, len(by_length), self.max_batch_size):
            batch = by_length[lo:lo + self.max_batch_size]
            seeds = [sample_seed(sampling.seed, call, prompt_offset + rows[r][0], rows[r][1]) for r in batch]
            for finished in self._decode_steps([prompts[rows[r][0]] for r in batch], seeds, sampling):
                yield [Sample(prompt_offset + rows[batch[i]][0], rows[batch[i]][1], tuple(tokens),
                              torch.tensor(logprobs, dtype=torch.float32), reason, self.adapter_version, routes,
                              self.policy_version) for i, (tokens, logprobs, reason, routes) in finished]

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingConfig,
                    seed: int) -> None:
        """Queue one request for the next :meth:`step` (:class:`~megarl.rollout.base.RequestEngine`).

        Raises:
            RolloutError: ``sampling.n != 1``, a bad prompt, a sleeping engine or no weights.
        """
        check_ready(self._asleep, self._has_weights)
        if sampling.n != 1:
            raise RolloutError(f"add_request takes one sample per request (sampling.n=1), got n={sampling.n}")
        prompt = check_prompts([prompt_token_ids], max_context=self.spec.max_position_embeddings,
                               vocab_size=self.spec.vocab_size)[0]
        self._queued.append((request_id, prompt, sampling, seed))

    def has_unfinished_requests(self) -> bool:
        """Whether requests are queued for the next :meth:`step`."""
        return bool(self._queued)

    def step(self) -> list[Completion]:
        """Generate every queued request to its end (micro-batches of ``max_batch_size`` rows sorted by prompt
        length, one batch family per sampling setting) and return them all."""
        queued, self._queued = self._queued, []
        families: dict[SamplingConfig, list[int]] = {}
        for k, (_, _, sampling, _) in enumerate(queued):  # one decode loop per sampling setting
            families.setdefault(dataclasses.replace(sampling, max_new_tokens=1, seed=0), []).append(k)
        done = []
        with torch.inference_mode():
            for rows in families.values():
                rows.sort(key=lambda k: len(queued[k][1]))
                for lo in range(0, len(rows), self.max_batch_size):
                    batch = [queued[k] for k in rows[lo:lo + self.max_batch_size]]
                    outs = self._generate_batch([b[1] for b in batch], [b[3] for b in batch], batch[0][2],
                                                limits=[b[2].max_new_tokens for b in batch])
                    done += [Completion(b[0], tuple(t), torch.tensor(lp, dtype=torch.float32), reason,
                                        policy_version=self.policy_version, routed_experts=routes)
                             for b, (t, lp, reason, routes) in zip(batch, outs)]
        return done

    def _generate_batch(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingConfig,
                        limits: list[int] | None = None
                        ) -> list[tuple[list[int], list[float], str, torch.Tensor | None]]:
        """Decode one micro-batch; returns ``(tokens, logprobs, finish reason, routes)`` per row, ``routes``
        ``[prompt + response tokens - 1, layers, top_k]`` int16 for an MoE model (every token but the last
        sampled one, which is never fed back), else None. ``limits``: each row's ``max_new_tokens`` (default
        ``sampling.max_new_tokens`` for all)."""
        results: list[Any] = [None] * len(prompts)
        for finished in self._decode_steps(prompts, seeds, sampling, limits):
            for i, out in finished:
                results[i] = out
        return results

    def _decode_steps(self, prompts, seeds, sampling, limits=None):
        """:meth:`_generate_batch`'s decode loop, one forward per ``next`` (inside the route recorder's hooks for an
        MoE model): yields the ``(row, (tokens, logprobs, finish reason, routes))`` of the rows that finished in it."""
        recording = self._routes.recording() if self._routes is not None else contextlib.nullcontext()
        with recording, torch.inference_mode():
            yield from self._decode(prompts, seeds, sampling, limits)

    def _decode(self, prompts, seeds, sampling, limits):
        """:meth:`_decode_steps`' loop: a generator, one forward per ``next``."""
        from transformers import DynamicCache

        rows, width = len(prompts), max(len(p) for p in prompts)
        pad = self.spec.pad_token_id if self.spec.pad_token_id is not None else 0
        input_ids = torch.full((rows, width), pad, dtype=torch.int64)
        mask = torch.zeros(rows, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        limits = limits or [sampling.max_new_tokens] * rows
        budget = [min(m, self.spec.max_position_embeddings - len(p)) for m, p in zip(limits, prompts)]
        stop = set(self.spec.eos_token_ids) | set(sampling.stop_token_ids)
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons = [""] * rows
        active = list(range(rows))  # batch row -> prompt row
        # each distinct prompt is prefilled once and its KV-cache rows copied to its samples (a prompt's n samples
        # share them, as in vLLM's prefix cache: n times less prefill)
        distinct: dict[tuple[int, ...], int] = {}  # prompt -> its prefill row
        pick: list[int] = []  # prefill row -> the first row of its prompt
        for i, p in enumerate(prompts):
            if distinct.setdefault(tuple(p), len(pick)) == len(pick):
                pick.append(i)
        first = torch.tensor([distinct[tuple(p)] for p in prompts])  # row -> its prompt's prefill row
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids[pick], attention_mask=mask[pick], position_ids=positions[pick],
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if len(pick) < rows:
            _keep_rows(cache, first)
            logits = logits[first]
        routes = None
        if self._routes is not None:  # per row, a list of [tokens, layers, top_k]: the prompt's, then each fed token's
            prefill = self._routes.take(len(pick), width)[first]
            routes = [[prefill[i, width - len(p):]] for i, p in enumerate(prompts)]
        next_pos = positions[:, -1] + 1
        yield []  # the prefill's forward
        while True:
            picked, picked_lp = sample_tokens(logits, sampling, [generators[a] for a in active])
            keep = []
            for b, (a, t, lp) in enumerate(zip(active, picked.tolist(), picked_lp.tolist())):
                tokens[a].append(t)
                logprobs[a].append(lp)
                if t in stop:
                    reasons[a] = "stop"
                elif len(tokens[a]) >= budget[a]:
                    reasons[a] = "length"
                else:
                    keep.append(b)
            kept = set(keep)
            done = [a for b, a in enumerate(active) if b not in kept]
            yield [(i, (tokens[i], logprobs[i], reasons[i], None if routes is None else torch.cat(routes[i])))
                   for i in done]
            if not keep:
                return
            if len(keep) < len(active):
                index = torch.tensor(keep)
                _keep_rows(cache, index)
                mask, next_pos, picked = mask[index], next_pos[index], picked[index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            logits = self.model(input_ids=picked.unsqueeze(1), attention_mask=mask,
                                position_ids=next_pos.unsqueeze(1), past_key_values=cache,
                                use_cache=True).logits[:, -1]
            if routes is not None:
                fed = self._routes.take(len(active), 1)
                for b, a in enumerate(active):
                    routes[a].append(fed[b])
            next_pos = next_pos + 1


def _keep_rows(cache, index: torch.Tensor) -> None:
    """Keep the batch rows ``index`` (int64 ``[rows]``, repeats allowed) of every layer of a transformers cache:
    the keys and values of an attention layer (``batch_select_indices``), the convolution and recurrent states
    of a linear-attention one (Qwen3.5's gated DeltaNet: ``reorder_cache``, which selects both kinds where a
    layer has both; its ``batch_select_indices`` would keep the keys and values alone, or is missing)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reorder_cache(index)
        else:
            layer.batch_select_indices(index)
