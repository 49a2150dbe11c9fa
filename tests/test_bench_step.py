"""``megarl bench step`` on the CPU (tiny model, synthetic task): the report's fields and units, never its
times; and the FLOP formula of :mod:`megarl.measure.flops` against a count by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from megarl.measure.flops import forward_flops, mfu, peak_bf16_flops, train_flops
from megarl.models.spec import ModelSpec
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

TINY = ModelSpec("llama", vocab_size=10, hidden_size=4, num_layers=2, num_attention_heads=2, num_kv_heads=1,
                 head_dim=2, ffn_hidden_size=6, tie_word_embeddings=True, eos_token_ids=(1,))


def _hand_forward_flops(spec: ModelSpec, s: int, out_rows: int) -> int:
    """Multiply-adds of every matmul of one causal forward pass, counted one product at a time, times 2."""
    h, q, k, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    macs = 0
    for _ in range(spec.num_layers):
        for _t in range(s):
            macs += h * q + h * k + h * k  # Q, K, V projections of one token
            macs += q * h  # output projection
            macs += 2 * h * f + f * h  # gate, up, down
        for t in range(s):  # causal attention: token t sees positions 0..t (the last `window` of them)
            for _j in range(max(0, t + 1 - (spec.sliding_window or t + 1)), t + 1):
                macs += q  # one score per query head channel (q_size products) ...
                macs += q  # ... and the weighted value sum
    macs += s * h * out_rows  # output layer
    return 2 * macs


def test_flops_equal_a_count_by_hand():
    for s in (1, 3, 7):
        assert forward_flops(TINY, [s]) == _hand_forward_flops(TINY, s, TINY.vocab_size)
        assert forward_flops(TINY, [s], output_rows=1) == _hand_forward_flops(TINY, s, 1)
    windowed = ModelSpec("phi3", 10, 4, 2, 2, 1, 2, 6, sliding_window=3)  # Phi-3-mini: a window on every layer
    for s in (2, 3, 7):
        assert forward_flops(windowed, [s]) == _hand_forward_flops(windowed, s, windowed.vocab_size)
    assert forward_flops(TINY, torch.tensor([3, 7])) == forward_flops(TINY, [3]) + forward_flops(TINY, [7])
    assert train_flops(TINY, [5]) == 3 * forward_flops(TINY, [5])
    assert mfu(2e12, 2.0, 2, 1e12) == 0.5 and mfu(1.0, 1.0, 1, None) is None
    assert peak_bf16_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert peak_bf16_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert peak_bf16_flops("cpu") is None
    with pytest.raises(ValueError, match="lengths"):
        forward_flops(TINY, [-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = make_tiny_model(root / "model")
    data = write_prompts(root / "prompts.jsonl", 32)
    out = root / "bench.json"
    args = [sys.executable, "-m", "megarl.cli", "bench", "step", *task_overrides(model, data, root / "runs", "b"),
            "data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
            "actor.max_tokens_per_micro_batch=32",  # the trainer's path with micro-batches by token count
            "--steps", "2", "--warmup", "1", "--peak-tflops", "0.001", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_bench_step_report_fields_and_units(report):
    r, stdout = report
    assert r["status"] == "ok" and r["steps"] == 2 and r["warmup"] == 1 and r["world_size"] == 1
    assert r["device"] == "cpu"
    assert r["config"]["layout"]["tp"] == 1 and r["config"]["layout"]["dp"] == 1
    assert "data.prompts_per_step=4" in r["config"]["overrides"]
    assert r["config"]["resolved"]["rollout"]["n"] == 4
    assert r["peak_tflops"]["datasheet"] == pytest.approx(0.001)
    phases = r["phases"]
    assert list(phases)[:6] == ["wake_up", "reshard", "generate", "reward", "old_logprobs", "reference"]
    assert "actor_update" in phases
    assert len(r["per_step"]) == 2
    # one batch: 4 prompts x 4 samples of 3-5 prompt words and 1-3 response tokens (max_new_tokens=3)
    gen, old, upd = phases["generate"], phases["old_logprobs"], phases["actor_update"]
    assert 16 <= gen["tokens"] <= 16 * 3 and float(gen["tokens"]).is_integer()
    assert old["tokens"] == upd["tokens"] == phases["reference"]["tokens"]
    assert gen["tokens"] + 16 * 3 <= old["tokens"] <= gen["tokens"] + 16 * 5
    assert phases["reshard"]["tokens"] is None and phases["reshard"]["mfu"] is None
    for name in ("old_logprobs", "actor_update"):
        p = phases[name]
        assert p["tokens_per_s"] == pytest.approx(p["tokens"] / p["time_s"])  # rates are per second
        assert p["tokens_per_s_per_gpu"] == pytest.approx(p["tokens_per_s"])  # one rank
        assert p["mfu"] == pytest.approx(p["flops"] / p["time_s"] / 1e9)  # a fraction of 0.001 TFLOP/s
    assert upd["flops"] == pytest.approx(3 * old["flops"])  # one epoch of forward + backward
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"])
    assert r["step_time_s"] >= sum(p["time_s"] for p in phases.values()) - 1e-6
    assert r["mfu_vs_measured"] is None  # no measured peak for the CPU
    assert r["peak_memory_bytes"] == max(p["peak_memory_bytes"] for p in phases.values()) > 10 * 2**20
    u = r["gpu_util"]
    assert u["source"] == "proc" and u["per_rank"][0]["samples"] >= 1
    assert 0 <= u["util_mean_pct"] and u["memory_max_bytes"] > 10 * 2**20  # bytes, not KiB or GiB
    assert all(math.isfinite(p["time_s"]) and p["time_s"] >= 0 for p in phases.values())
    assert "actor_update" in stdout and "tokens/s/GPU" in stdout
    m = r["machine"]  # what ran it, for the speed gate's history
    assert m["gpu"] == "cpu" and m["gpus"] == 1 and m["torch"] == torch.__version__ and m["host"]
    assert m["commit"] is None or len(m["commit"]) == 40
    q = r["rollout"]  # the mismatch figures of megarl.algos.mismatch, means over the measured steps
    assert q["token_mult_prob_error"] >= 1.0 and q["gen_kl_error"] >= 0.0
    assert q["abs_diff_max"] >= q["abs_diff_p99"] >= 0.0 and q["abs_diff_max"] >= q["rollout_vs_old_logprob_diff"]


def test_the_speed_gate_on_a_real_report(report, tmp_path, capsys):
    """The CPU report: not compared against an empty history, appended; then the same report passes against
    it and a copy with the step and update 30% slower fails on those two figures."""
    from megarl.bench.gate import gate

    r, _ = report
    path, history = tmp_path / "report.json", tmp_path / "history.jsonl"
    path.write_text(json.dumps(r))
    assert gate(path, "cpu-tiny", history_path=history, append=True) == 0
    assert "not compared" in capsys.readouterr().out
    assert gate(path, "cpu-tiny", history_path=history) == 0
    assert capsys.readouterr().out.rstrip().endswith("on 1 x cpu: PASS")
    slow = json.loads(json.dumps(r))
    slow["step_time_s"] *= 1.3
    slow["phases"]["actor_update"]["time_s"] *= 1.3
    path.write_text(json.dumps(slow))
    assert gate(path, "cpu-tiny", history_path=history) == 1
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("REGRESSED")] == [
        "step_time_s", "actor_update.time_s"]


def test_bench_step_on_two_ranks(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 32)
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "megarl.cli", "bench", "step", *task_overrides(model, data, tmp_path / "runs", "b"),
            "actor.parallel.dp=2", "data.prompts_per_step=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=2", "--steps", "1", "--warmup", "0", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)  # relaunched under torchrun
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Setting OMP_NUM_THREADS" not in proc.stderr  # torchrun's banner: megarl sets each rank's threads
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["world_size"] == 2 and r["config"]["layout"]["dp"] == 2
    assert len(r["gpu_util"]["per_rank"]) == 2
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
    upd = r["phases"]["actor_update"]
    assert upd["tokens_per_s_per_gpu"] == pytest.approx(upd["tokens"] / upd["time_s"] / 2)
    assert r["mfu"] is None  # no peak on the CPU


def test_bench_step_never_writes_into_the_training_runs_folder():
    """Issue 24: with run.name left as the config has it, bench step wrote bench_step.json (and its trainer's
    files) into the main training run's folder."""
    from megarl.cli.bench import bench_step_config
    from megarl.config import load_config

    train = load_config(None, [])
    assert bench_step_config(None, []).run.run_dir == train.run.run_dir.parent / f"bench-{train.run.name}"
    assert bench_step_config(None, ["run.name=mine"]).run.name == "mine"


def test_bench_step_bad_flag_is_one_error_line():
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "step", "--warmup", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["megarl: error: bench step: argument --warmup: --warmup must be "
                                                ">= 0, got -1 (see megarl bench step --help)"]


def test_standalone_vllm_needs_vllm_rollouts():
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "step", "--standalone-vllm",
                           "rollout.engine=hf"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--standalone-vllm compares with vLLM rollouts" in proc.stderr and "rollout.engine" in proc.stderr


def test_generate_recorder_keeps_the_calls_and_forwards_the_rest():
    from megarl.bench.vllm_standalone import GenerateRecorder
    from megarl.rollout.base import RolloutOutput, Sample, SamplingConfig

    class Engine:
        calls = 0

        def generate(self, prompts, sampling, prompt_offset=0):
            samples = [Sample(k, j, tuple(range(k + j + 1)), torch.zeros(k + j + 1), "length")
                       for k in range(len(prompts)) for j in range(sampling.n)]
            return RolloutOutput.collect(samples, sampling.n, prompts, 0.5)

    engine = Engine()
    rec = GenerateRecorder(engine)
    rec.generate([[1, 2]], SamplingConfig(n=2, max_new_tokens=4))  # not recording yet
    rec.recording = True
    rec.generate([[1, 2], [3]], SamplingConfig(n=2, temperature=0.7, max_new_tokens=4))
    assert rec.recorded == [{"prompts": [[1, 2], [3]], "n": 2, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                             "lengths": [1, 2, 2, 3], "seconds": 0.5}]
    rec.calls = 5  # the trainer restores the engine's call counter through the wrapper
    assert engine.calls == 5 and rec.calls == 5


def _standalone_on_fake_vllm(rank: int, world: int, request: dict) -> dict:
    from tests.test_rollout_vllm_tp import _fake_vllm

    _fake_vllm()
    import vllm

    from megarl.bench.vllm_standalone import run_standalone

    asked, generate = set(), vllm.LLM.generate

    def recording(self, prompts, params, *args, **kwargs):  # what the baseline's requests ask of vLLM
        asked.update(p.logprobs for p in params)
        return generate(self, prompts, params, *args, **kwargs)

    vllm.LLM.generate = recording
    return {**run_standalone(request), "asked": asked}


def test_the_standalone_baseline_is_the_median_of_its_timed_passes(tmp_path):
    """On the fake vLLM (tests/fake_vllm): the baseline builds the rollout engine with the run's settings,
    generates every recorded call to its recorded lengths once per pass after a warm-up, and reports the median
    pass with every pass and the spread."""
    from megarl.models.spec import ModelSpec
    from megarl.rollout.vllm_engine import VLLMSettings, write_model_dir
    from tests.distributed import run_world

    spec = ModelSpec("llama", 50, 16, 1, 2, 1, 8, 24, max_position_embeddings=32, eos_token_ids=(1,))
    write_model_dir(spec, tmp_path)
    calls = [{"prompts": [[3, 4], [5]], "n": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
              "lengths": [3, 1, 7, 2], "seconds": 0.1},
             {"prompts": [[6]], "n": 3, "temperature": 0.5, "top_p": 1.0, "top_k": -1, "lengths": [4, 4, 5],
              "seconds": 0.1}]
    def request(**settings) -> dict:
        return {"model_dir": str(tmp_path), "calls": calls, "repeats": 3,
                "engine": {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 32, "seed": 0,
                           "settings": VLLMSettings(request_seeds=False, max_num_seqs=8, **settings).as_dict()}}

    r = run_world(_standalone_on_fake_vllm, 1, request(), timeout_s=120)[0]
    assert r["asked"] == {None}  # as the RL engine's requests: its sampler's log-probs (rollout.logprobs: null)
    assert run_world(_standalone_on_fake_vllm, 1, request(logprobs="output"), timeout_s=120)[0]["asked"] == {0}
    assert r["status"] == "ok" and r["repeats"] == 3 and len(r["tokens_per_s_runs"]) == 3
    assert r["tokens"] == 26 and [c["tokens"] for c in r["per_call"]] == [13, 13]
    assert r["tokens_per_s"] == sorted(r["tokens_per_s_runs"])[1]
    runs = r["tokens_per_s_runs"]
    assert r["spread"] == pytest.approx((max(runs) - min(runs)) / r["tokens_per_s"])
