"""``rollout.logprobs: sampler`` (:mod:`megarl.rollout.vllm_logprobs`) on a CPU.

:func:`~megarl.rollout.vllm_logprobs.assemble` against a plain-Python reference (each output token's log-prob is
that of the last kept sampler row of its request at its index) on continuous-batching runs with chunked prefill,
preemption, async rows past the stop, requests that are not collected (aborted) and several samples of one
prompt; its refusals. The vLLM engine through the fake vLLM (:mod:`tests.fake_vllm.vllm`, whose V1 and V2 model
runners hand their sampler rows to the hooks) gives the same rollout batch with ``sampler`` as with ``output``.
The bit-for-bit check against vLLM's own ``logprobs=0`` is tests/test_gpu_logprobs.py.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.rollout.base import RolloutError
from megarl.rollout.vllm_logprobs import Step, assemble
from tests.distributed import run_world
from tests.test_rollout_vllm_tp import _fake_vllm

PROMPTS = [[3, 5, 7], [11], [2, 4, 6, 8, 10], [9, 9], [1, 2, 3, 4, 5, 6, 7], [13, 1, 4]]


def _requests(count: int, seed: int) -> list[tuple[str, int, list[int], list[float]]]:
    rng = random.Random(seed)
    return [(f"{k}-{rng.randrange(16 ** 8):08x}", rng.randint(1, 7), [rng.randrange(50) for _ in range(n)],
             [-rng.random() * 4 for _ in range(n)]) for k in range(count) for n in [rng.randint(1, 9)]]


def _steps(rows_per_step, as_tensors: bool) -> list[Step]:
    def field(values, dtype):
        return torch.tensor(values, dtype=dtype) if as_tensors else np.array(values)

    return [Step([r.req_id for r in rows], field([r.index for r in rows], torch.int64),
                 field([r.kept for r in rows], torch.bool), torch.tensor([r.token for r in rows], dtype=torch.int32),
                 torch.tensor([r.logprob for r in rows], dtype=torch.float32)) for rows in rows_per_step]


def _reference(rows_per_step, requests) -> dict[str, list[float]]:
    """Plain Python: output token t of a request is its last kept row at index prompt + t."""
    out = {}
    for rid, (plen, tokens) in requests.items():
        values = []
        for t, token in enumerate(tokens):
            hits = [r for rows in rows_per_step for r in rows if r.req_id == rid and r.kept and r.index == plen + t]
            assert hits[-1].token == token
            values.append(float(np.float32(hits[-1].logprob)))
        out[rid] = values
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("as_tensors", [False, True])
def test_assemble_equals_the_plain_python_reference(seed, as_tensors):
    from tests.fake_vllm.vllm.runners import sampler_rows

    reqs = _requests(10, seed)
    rows = sampler_rows(reqs, seed=seed)
    assert any(not r.kept and r.index >= reqs[int(r.req_id.split("-")[0])][1] for s in rows for r in s), \
        "the run recomputes a preempted request (discarded rows inside its output)"
    collected = {rid: (plen, tokens) for rid, plen, tokens, _ in reqs[1:]}  # request 0: aborted, not collected
    got = assemble(_steps(rows, as_tensors), collected)
    want = _reference(rows, collected)
    assert {k: v.tolist() for k, v in got.items()} == want
    assert all(v.dtype == np.float32 for v in got.values())
    assert want == {rid: [float(np.float32(v)) for v in values] for rid, _, _, values in reqs[1:]}


def test_assemble_takes_the_last_kept_row_and_samples_of_one_prompt_apart():
    from tests.fake_vllm.vllm.runners import Row

    rows = [[Row("a-1", 3, True, 7, -1.0), Row("b-2", 3, True, 8, -2.0)],  # two samples of one 3-token prompt
            [Row("a-1", 4, True, 5, -0.5), Row("b-2", 3, True, 8, -2.5)],  # b's token 0 sampled again (last wins)
            [Row("a-1", 5, True, 1, -9.0), Row("b-2", 2, False, 8, -7.0)]]  # a: past its stop; b: a discarded row
    got = assemble(_steps(rows, False), {"a-1": (3, [7, 5]), "b-2": (3, [8])})
    assert {k: v.tolist() for k, v in got.items()} == {"a-1": [-1.0, -0.5], "b-2": [-2.5]}


def test_assemble_refuses_missing_rows_and_other_tokens():
    from tests.fake_vllm.vllm.runners import Row

    rows = [[Row("a-1", 3, True, 7, -1.0)], [Row("a-1", 4, False, 5, -0.5)]]
    with pytest.raises(RolloutError, match=r"1 of 2 output tokens have no sampler row \(e.g. request 'a-1' token 1\)"):
        assemble(_steps(rows, False), {"a-1": (3, [7, 5])})
    with pytest.raises(RolloutError, match=r"request 'a-1' token 0: output 6, row 7"):
        assemble(_steps(rows[:1], False), {"a-1": (3, [6])})


def _turns(engine, sampling) -> dict:
    """Multi-turn episodes on ``engine.add_request`` / ``step``, one per prompt of :data:`PROMPTS`: episode ``e``
    starts at step ``e``, each of its 3 turns (prompt: the last turn's prompt, its tokens and 2 observation tokens)
    one or two steps after the last finished. Returns each turn's (tokens, log-prob bytes, finish reason)."""
    episodes = {e: {"prompt": p, "turn": 0, "at": e} for e, p in enumerate(PROMPTS)}
    running, out, step = {}, {}, 0
    while episodes:
        for e, ep in episodes.items():
            if ep["at"] <= step and e not in running.values():
                running[f"megarl-{e}-{ep['turn']}"] = e
                engine.add_request(f"megarl-{e}-{ep['turn']}", ep["prompt"], sampling, seed=100 * e + ep["turn"])
        for c in engine.step() if engine.has_unfinished_requests() else []:
            e = running.pop(c.request_id)
            ep = episodes[e]
            out[c.request_id] = (c.token_ids, c.logprobs.dtype, c.logprobs.numpy().tobytes(), c.finish_reason)
            ep["turn"], ep["prompt"] = ep["turn"] + 1, ep["prompt"] + list(c.token_ids) + [1, 2]
            ep["at"] = step + 1 + e % 2
            if ep["turn"] == 3:
                del episodes[e]
        step += 1
    return out


def _engines_on_fake_vllm(rank: int, world: int) -> dict:
    _fake_vllm()
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings

    spec = ModelSpec("llama", 64, 16, 1, 2, 1, 8, 32, tie_word_embeddings=True, max_position_embeddings=64)

    def _engine(runner: str, source: str) -> VLLMRolloutEngine:  # one engine of the fake vLLM, weights 0.25
        engine = VLLMRolloutEngine(spec, settings=VLLMSettings(model_runner=runner, logprobs=source))
        engine.update_weights(lambda params: [p.fill_(0.25) for p in params.values()])
        return engine

    out = {}
    for runner in ("v1", "v2"):
        for temperature in (1.0, 0.0):
            sampling = SamplingConfig(n=1, temperature=temperature, max_new_tokens=6, seed=5, stop_token_ids=(0,))
            turns = {}
            for source in ("output", "sampler"):
                engine = _engine(runner, source)
                turns[source] = _turns(engine, sampling)
                turns[source + "_asked"] = set(engine.llm.llm_engine.asked)
            out[("turns", runner, temperature)] = turns
        for temperature in (1.0, 0.0):
            sampling = SamplingConfig(n=3, temperature=temperature, max_new_tokens=6, seed=5, stop_token_ids=(0,))
            batches = {}
            for source in ("output", "sampler"):
                engine = _engine(runner, source)
                result = engine.generate(PROMPTS, sampling, prompt_offset=2)
                batches[source] = [(s.prompt_index, s.sample_index, s.token_ids, s.logprobs.dtype,
                                    s.logprobs.numpy().tobytes(), s.finish_reason) for s in result.samples]
                batches[source + "_runner"] = type(engine._runner).__name__
            out[(runner, temperature)] = batches
    return out


@pytest.fixture(scope="module")
def engines():
    return run_world(_engines_on_fake_vllm, 1)[0]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampler_logprobs_give_the_same_rollout_batch_as_vllms_output(engines, runner, temperature):
    batches = engines[(runner, temperature)]
    assert batches["sampler_runner"] == batches["output_runner"] == f"Runner{runner.upper()}"
    assert len(batches["output"]) == len(PROMPTS) * 3
    assert sum(len(b[2]) for b in batches["output"]) > 3 * len(PROMPTS)  # more than one token a sample
    assert batches["sampler"] == batches["output"]


def _sources_by_default(rank: int, world: int) -> dict:
    _fake_vllm()
    from vllm import runners

    from megarl.models.spec import ModelSpec
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings

    spec = ModelSpec("llama", 64, 16, 1, 2, 1, 8, 32, tie_word_embeddings=True, max_position_embeddings=64)

    def source(**settings) -> str:
        try:
            engine = VLLMRolloutEngine(spec, settings=VLLMSettings(model_runner="v1", **settings))
            return f"{type(engine._logprobs).__name__}/{engine.logprobs_source}"
        except RolloutError as e:
            return f"RolloutError: {e}"

    out = {"default": source(), "output": source(logprobs="output")}
    runners._SamplerV1.logprobs_mode = "raw_logprobs"  # a runner whose sampler the capture cannot read
    out.update(fallback=source(), asked=source(logprobs="sampler"))
    return out


def test_the_sampler_is_the_default_source_and_output_the_fallback():
    """``rollout.logprobs: null`` reads the sampler; where the capture cannot (here a sampler in another log-prob
    mode) it falls back to vLLM's output, while an explicit ``sampler`` is an error."""
    got = run_world(_sources_by_default, 1)[0]
    assert (got["default"], got["output"], got["fallback"]) == ("SampledLogprobs/sampler", "OutputLogprobs/output",
                                                                "OutputLogprobs/output")
    assert got["asked"].startswith("RolloutError: rollout.logprobs=sampler: the sampler's logprobs_mode is "
                                   "'raw_logprobs'")


def test_config_refuses_other_sources_and_the_hf_engine():
    assert load_config(None, ["rollout.engine=vllm"]).rollout.logprobs is None  # the sampler's, where it applies
    assert load_config(None, ["rollout.engine=vllm", "rollout.logprobs=sampler"]).rollout.logprobs == "sampler"
    assert load_config(None, ["rollout.logprobs=output"]).rollout.logprobs == "output"
    with pytest.raises(ConfigError, match=r"rollout\.logprobs: must be null \(the sampler's where it applies\) or one "
                                          r"of \['output', 'sampler'\], got 'gpu'"):
        load_config(None, ["rollout.engine=vllm", "rollout.logprobs=gpu"])
    with pytest.raises(ConfigError, match=r"rollout\.logprobs: sampler reads vLLM's sampler, but rollout\.engine=hf"):
        load_config(None, ["rollout.logprobs=sampler"])


# ---------------------------------------------------------------------- request by request (add / step)
def test_output_table_reclaims_closed_requests_and_keeps_the_last_row_across_writes(monkeypatch):
    from megarl.rollout.vllm_logprobs import OutputTable
    from tests.fake_vllm.vllm.runners import Batch, Row

    compactions = []
    original = OutputTable._compact
    monkeypatch.setattr(OutputTable, "_compact", lambda self, need: (compactions.append(len(self._slot)),
                                                                      original(self, need))[1])
    rng = random.Random(3)
    batch, table, requests, got, dropped = Batch(seed=3), OutputTable(), {}, {}, set()
    for step in range(400):
        if step < 250 and rng.random() < 0.4:
            rid = f"r{len(requests)}-0000000{len(requests) % 10}"
            n = rng.randint(1, 9)
            requests[rid] = (rng.randint(1, 40), [rng.randrange(50) for _ in range(n)],
                             [-rng.random() for _ in range(n)])
            table.open(rid, requests[rid][0], 300 + rng.randint(0, 3) * n)  # capacities past the output: wide cells
            batch.add((rid, *requests[rid]))
        rows, done = batch.step()
        table.write(_steps([rows], as_tensors=bool(step % 2)))
        if len(requests) % 7 == 3 and requests and (last := list(requests)[-1]) in table and last not in done:
            table.drop([last])  # aborted while running: its later rows are ignored
            dropped.add(last)
        for rid in done:
            if rid not in dropped:
                got.update(table.close({rid: requests[rid][1]}))
    assert not batch.busy() and len(got) == len(requests) - len(dropped) > 30 and dropped
    assert {r: v.tolist() for r, v in got.items()} == {r: [float(np.float32(x)) for x in requests[r][2]]
                                                        for r in got}
    assert len(compactions) >= 3 and max(compactions) > 0  # live requests moved at least once
    assert len(table._tokens) <= 4 * 1024, len(table._tokens)  # closed requests' cells were reused, not kept
    assert len(table._base) <= 32, len(table._base)  # and so were their slots
    table.open("a-1", 3, 2)
    table.write(_steps([[Row("a-1", 3, True, 7, -1.0)], [Row("a-1", 4, True, 5, -0.5)]], False))
    table.write(_steps([[Row("a-1", 3, True, 8, -2.0), Row("a-1", 3, False, 9, -3.0)]], False))  # recomputed
    assert table.close({"a-1": [8, 5]})["a-1"].tolist() == [-2.0, -0.5]


class _StepEngine:
    """``LLMEngine`` over a fake model runner: requests join between steps (:class:`~tests.fake_vllm.vllm.runners.
    Batch`: chunked prefill, preemption, a row past the stop), each finishing the step its last token is sampled;
    ``aborted`` external ids finish with ``finish_reason="abort"`` one token short."""

    def __init__(self, runner, greedy: bool, aborted=()):
        from tests.fake_vllm.vllm.runners import Batch

        self.runner, self.greedy, self.aborted = runner, greedy, set(aborted)
        self.batch, self.requests = Batch(seed=1), {}

    def add(self, external: str, prompt_len: int, tokens: list[int], values: list[float]) -> str:
        internal = f"{external}-{len(self.requests):08x}"
        self.requests[internal] = (external, tokens)
        self.batch.add((internal, prompt_len, tokens, values))
        return internal

    def step(self) -> list:
        from types import SimpleNamespace

        rows, done = self.batch.step()
        if rows:
            self.runner.run_step(rows, 1000, self.greedy)
        outputs = []
        for internal in done:
            external, tokens = self.requests[internal]
            reason = "abort" if external in self.aborted else "stop"
            outputs.append(SimpleNamespace(request_id=external, finished=True, outputs=[SimpleNamespace(
                token_ids=tokens[:-1] if reason == "abort" else tokens, finish_reason=reason)]))
        return outputs + [SimpleNamespace(request_id="still-running", finished=False, outputs=[])]


def _episodes(capture, engine, seed: int, rounds: int = 2, aborted=()) -> tuple[dict, dict]:
    """Several multi-turn episodes per round (each round's request ids start again at 0, as each rollout call's
    generation loop does): an episode's first turn joins at a staggered step, each next turn (prompt: the last
    turn's prompt, its tokens and 3 observation tokens) one or two steps after its last turn finished. Returns
    the log-probs the capture gave per (round, request id) and the values sampled there."""
    rng = random.Random(seed)
    got, want = {}, {}
    for r in range(rounds):
        ids = iter(range(1000))
        episodes = [{"prompt": rng.randint(2, 9), "turns": 0, "at": 2 * e, "running": None} for e in range(5)]
        step = 0
        while any(e["turns"] < 3 or e["running"] for e in episodes):
            for e in episodes:
                if e["running"] is None and e["turns"] < 3 and step >= e["at"]:
                    rid, n = f"megarl-{next(ids)}", rng.randint(1, 8)
                    tokens, values = [rng.randrange(50) for _ in range(n)], [-rng.random() * 3 for _ in range(n)]
                    capture.add(rid, e["prompt"], n + rng.randint(0, 2),
                                lambda: engine.add(rid, e["prompt"], tokens, values))
                    e["running"], e["turns"] = (rid, tokens), e["turns"] + 1
                    want[(r, rid)] = values
            for out, values in capture.step(engine.step):
                got[(r, out.request_id)] = None if values is None else values.tolist()
                e = next(e for e in episodes if e["running"] and e["running"][0] == out.request_id)
                e["prompt"] += len(e["running"][1]) + 3
                e["running"], e["at"] = None, step + rng.randint(1, 2)
            step += 1
    return got, want


@pytest.mark.parametrize("greedy", [False, True])
def test_request_path_gives_every_turn_its_sampled_logprobs(greedy):
    from megarl.rollout.vllm_logprobs import SampledLogprobs
    from tests.fake_vllm.vllm.runners import RunnerV1

    runner = RunnerV1(None)
    capture = SampledLogprobs(runner, v2=False)
    engine = _StepEngine(runner, greedy, aborted={"megarl-4"})
    got, want = _episodes(capture, engine, seed=int(greedy))
    assert len(got) == len(want) == 2 * 5 * 3
    assert got.pop((0, "megarl-4")) is None and got.pop((1, "megarl-4")) is None  # aborted by vLLM: no check
    assert got == {k: [float(np.float32(v)) for v in want[k]] for k in got}
    assert not capture._internal and not capture._table._slot and not capture._copies  # nothing left behind


def test_request_path_with_the_v2_runner(monkeypatch):
    import sys

    from megarl.rollout.vllm_logprobs import SampledLogprobs
    from tests.fake_vllm.vllm.runners import RunnerV2
    from tests.fake_vllm.vllm.v1.worker.gpu.sample import logprob

    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.sample.logprob", logprob)
    runner = RunnerV2(None)
    got, want = _episodes(SampledLogprobs(runner, v2=True), _StepEngine(runner, greedy=False), seed=2)
    assert len(got) == 30 and got == {k: [float(np.float32(v)) for v in want[k]] for k in got}


def test_request_path_waits_only_for_the_copies_of_finished_requests(monkeypatch):
    from megarl.rollout import vllm_logprobs
    from tests.fake_vllm.vllm.runners import RunnerV1

    class Event:  # a copy that arrives only when waited for
        def __init__(self):
            self.done = False
            events.append(self)

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    events: list[Event] = []
    to_host = vllm_logprobs._to_host
    monkeypatch.setattr(vllm_logprobs, "_to_host", lambda step: dataclasses.replace(to_host(step), copied=Event()))
    runner = RunnerV1(None)
    capture = vllm_logprobs.SampledLogprobs(runner, v2=False)
    engine = _StepEngine(runner, greedy=False)
    capture.add("a", 3, 4, lambda: engine.add("a", 3, [1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0]))
    assert capture.step(engine.step) == [] and capture.step(engine.step) == []  # a's prefill chunks, token 0
    assert len(events) == 2 and not any(e.done for e in events) and len(capture._copies) == 2
    capture.add("b", 2, 1, lambda: engine.add("b", 2, [7], [-0.5]))
    steps = 0
    while not (done := capture.step(engine.step)):
        steps += 1
    (out, values), = done
    assert out.request_id == "b" and values.tolist() == [-0.5]
    assert all(e.done for e in events) and not capture._copies  # b's last row came with this step's copy
    for _ in range(3):
        done += capture.step(engine.step)
    assert [o.request_id for o, _ in done] == ["b", "a"] and done[1][1].tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_request_path_refusals():
    from types import SimpleNamespace

    from megarl.rollout.vllm_logprobs import SampledLogprobs
    from tests.fake_vllm.vllm.runners import RunnerV1

    runner = RunnerV1(None)
    capture = SampledLogprobs(runner, v2=False)
    engine = _StepEngine(runner, greedy=False)
    capture.add("a", 3, 2, lambda: engine.add("a", 3, [1, 2], [-1.0, -2.0]))
    with pytest.raises(RolloutError, match=r"request 'a' is still running"):
        capture.add("a", 3, 2, lambda: pytest.fail("a second 'a' reached vLLM"))
    with pytest.raises(ValueError, match="refused"):
        capture.add("b", 3, 2, lambda: (_ for _ in ()).throw(ValueError("refused")))
    assert "b" not in capture._internal  # vLLM refused it: nothing collected
    stray = SimpleNamespace(request_id="x", finished=True,
                            outputs=[SimpleNamespace(token_ids=[1], finish_reason="stop")])
    with pytest.raises(RolloutError, match=r"vLLM finished request 'x', which was not added"):
        capture.step(lambda: [stray])
    engine.requests["a-00000000"] = ("a", [1, 3])  # vLLM's output differs from what its sampler sampled
    with pytest.raises(RolloutError, match=r"request 'a-00000000' token 1: output 3, row 2"):
        while True:
            capture.step(engine.step)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampler_logprobs_give_multi_turn_episodes_the_same_turns_as_vllms_output(engines, runner, temperature):
    turns = engines[("turns", runner, temperature)]
    assert turns["output_asked"] == {0} and turns["sampler_asked"] == {None}  # vLLM's log-probs asked for or not
    assert len(turns["output"]) == 3 * len(PROMPTS) and sum(len(t[0]) for t in turns["output"].values()) > 40
    assert turns["sampler"] == turns["output"]
