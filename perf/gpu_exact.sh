#!/usr/bin/env bash
# Exact on-policy (rollout.exact, issue 46) on the GPU machine, in one command, from the repo root:
#   bash perf/gpu_exact.sh
#
# Before it, the vLLM 0.24.0 wheels must be in /tmp/whl (GPU.md, "Bringing packages over"; as for
# perf/gpu_vllm.sh, carry .whl). This command then
#   1. installs the wheels (skipped on a kept machine, as gpu_vllm.sh does);
#   2. runs tests/test_gpu_exact.py: the probe (vLLM's prefill against the trainer's exact pass tensor by tensor,
#      naming the first that differs), then the trainer's old log-probs against vLLM's in its batch-invariant
#      mode, bit for bit, on the tiny model and on SmolLM2-135M (SMOL_GGUF, perf/gpu_lib.sh's smol_gguf), at
#      the first step and after updates;
#   3. builds megarl._C, then runs the 1.5B bench step (perf/gpu_bench_step.sh grpo-1.5b-fast) without and with
#      rollout.exact=true, back to back on this GPU, and prints the step, generation and training phases of both
#      and their ratio (the issue's goal: at most 15% on the step);
#   4. (before 3) trains the tiny synthetic task with rollout.engine=vllm and rollout.exact=true twice for 20
#      steps with the same seed and checks that every metric but the timings is identical, that
#      mismatch/exact_tokens_frac is 1.0 at every step, and that the two final checkpoints hold the same weights
#      bit for bit.
#   5. trains the Qwen2.5-1.5B shape (random weights) with rollout.exact=true for 50 GRPO steps (8 prompts x 8, 64
#      new tokens, lr 1e-4) and checks that mismatch/exact_tokens_frac is 1.0 after every refit (refits_1p5b).
# The 100-step learning pair (SmolLM2 on GSM8K with and without rollout.exact) is perf/gpu_exact_learning.sh.
# Logs and run folders go to $OUT (default runs/gpu_exact). Each stage prints PASS or FAIL (with the tail of its
# log); the last line is "gpu_exact: PASS" or "gpu_exact: FAIL", the exit status 0 or 1. Stages share a budget of
# 570 s of wall time (BUDGET_S); on one call of the GPU machine run STAGES="test_gpu_exact seeded_pair", then
# STAGES=bench_pair, then STAGES=refits_1p5b, on the kept machine with the same OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension, synthetic_task, smol_gguf
begin gpu_exact 570

bench_pair() {  # the 1.5B bench step without, then with rollout.exact, on this machine (megarl._C built first)
  local status=0
  build_extension || return 1
  # without the standalone-vLLM baseline (STANDALONE=0): with it the pair outran a 10-minute call (2026-12-07)
  STANDALONE=0 OUT=$OUT/bench_plain bash perf/gpu_bench_step.sh grpo-1.5b-fast || status=1
  STANDALONE=0 OUT=$OUT/bench_exact bash perf/gpu_bench_step.sh grpo-1.5b-fast rollout.exact=true || status=1
  python3 - "$OUT/bench_plain/grpo-1.5b-fast.json" "$OUT/bench_exact/grpo-1.5b-fast.json" <<'EOF' || status=1
import json
import sys

plain, exact = (json.load(open(p)) for p in sys.argv[1:3])
for r in (plain, exact):
    assert r["status"] == "ok", r.get("error")
rows = [("step", plain["step_time_s"], exact["step_time_s"])]
for phase in sorted(set(plain["phases"]) & set(exact["phases"])):
    a, b = plain["phases"][phase].get("time_s"), exact["phases"][phase].get("time_s")
    if a and b:
        rows.append((phase, a, b))
for name, a, b in rows:
    print(f"exact overhead {name}: {a:.2f} s -> {b:.2f} s ({b / a - 1:+.1%})")
print("rollout vs actor with exact: " + ", ".join(f"{k} {v:.4g}" for k, v in (exact.get("rollout") or {}).items()))
EOF
  return $status
}

seeded_pair() {  # two seeded 20-step exact runs of the tiny task: identical metrics and final weights
  local task=$OUT/task
  rm -rf "$task" && mkdir -p "$task"
  python3 - "$task" > "$task/overrides.txt" <<'EOF' || return 1
import sys
from pathlib import Path

from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

root = Path(sys.argv[1])
print("\n".join(task_overrides(make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 64),
                               root / "runs", "NAME")))
EOF
  local overrides name
  for name in exact-a exact-b; do
    mapfile -t overrides < <(sed "s/NAME/$name/" "$task/overrides.txt")
    python3 -m megarl.cli train "${overrides[@]}" rollout.engine=vllm model.dtype=bfloat16 rollout.exact=true \
      rollout.gpu_memory_utilization=0.3 trainer.steps=20 trainer.save_every=20 data.prompts_per_step=8 \
      rollout.n=8 actor.ppo_mini_batch_size=32 actor.micro_batch_size=16 actor.optim.lr=3e-3 run.seed=7 || return 1
  done
  # python3 -c, not a script on stdin: the export's worker process (spawned) imports the main module by its path
  local check
  check=$(cat <<'EOF'
import json
import sys
from pathlib import Path

TIMING = ("time/", "throughput/", "perf/", "memory/", "pool/")  # seconds, rates and busy/idle shares

def steps(name):
    lines = (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(l).items() if not k.startswith(TIMING)} for l in lines if l.strip()]

a, b = steps("exact-a"), steps("exact-b")
assert len(a) == len(b) == 20, (len(a), len(b))
for s, t in zip(a, b):
    diff = {k: (s.get(k), t.get(k)) for k in set(s) | set(t) if s.get(k) != t.get(k)}
    assert not diff, f"step {s['step']}: the two seeded runs differ in {sorted(diff)[:8]}"
fracs = [s["mismatch/exact_tokens_frac"] for s in a]
print("exact_tokens_frac by step:", " ".join(f"{f:.4f}" for f in fracs))
print("reward by step:", " ".join(f"{s['reward/mean']:.3f}" for s in a))
assert all(f == 1.0 for f in fracs), "trainer and vLLM log-probs differ at some step"


import torch
from safetensors.torch import load_file

from megarl.launch.convert import export_to_hf

weights = []  # each run's final checkpoint as its Hugging Face tensors
for name in ("exact-a", "exact-b"):
    hf = export_to_hf(str(Path(sys.argv[1]) / name / "checkpoints" / "step_000020"),
                      str(Path(sys.argv[1]) / f"{name}-hf"))
    weights.append({k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()})
wa, wb = weights
differ = sorted(k for k in wa if k not in wb or not torch.equal(wa[k], wb[k]))
assert wa.keys() == wb.keys() and not differ, f"the final weights differ in {differ[:8]}"
print(f"final weights: {len(wa)} tensors equal bit for bit")
EOF
)
  python3 -c "$check" "$task/runs"
}

refits_1p5b() {  # the 1.5B random-weight shape trained 50 GRPO steps with rollout.exact: bit for bit after each refit
  local task=$OUT/refits
  synthetic_task "$task" 512 || return 1
  rm -rf "$task/runs"
  # lr 1e-4: each update moves the bf16 weights (a smaller step may round to no change), so each refit is new
  python3 -m megarl.cli train model.path=preset:qwen2.5-1.5b "${SYN[@]}" model.dtype=bfloat16 rollout.engine=vllm \
    rollout.exact=true rollout.gpu_memory_utilization=0.3 rollout.max_new_tokens=64 data.prompts_per_step=8 rollout.n=8 \
    actor.ppo_mini_batch_size=64 actor.micro_batch_size=16 actor.optim.lr=1e-4 trainer.steps=50 \
    trainer.save_every=0 validation.enabled=false trainer.progress=false trainer.report=false \
    run.output_dir="$task/runs" run.name=refits || return 1
  python3 - "$task/runs/refits/metrics.jsonl" <<'EOF'
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
fracs = [r["mismatch/exact_tokens_frac"] for r in rows]
print("1.5B exact_tokens_frac by step:", " ".join(f"{f:.4f}" for f in fracs))
print("1.5B max |diff| by step:", " ".join(f"{r['mismatch/abs_diff_max']:.3g}" for r in rows))
assert len(rows) == 50, f"{len(rows)} steps of 50"
assert all(f == 1.0 for f in fracs), "trainer and vLLM log-probs differ at some step"
EOF
}

export -f install_wheels build_extension synthetic_task bench_pair seeded_pair refits_1p5b

smol_gguf  # the smollm2 case of the test
stage install 200 install_wheels
if [ $failed -eq 0 ]; then  # all run, so that one GPU session reports on each
  stage test_gpu_exact 480 "python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_exact.py"
  stage seeded_pair 300 seeded_pair
  stage bench_pair 540 bench_pair
  stage refits_1p5b 400 refits_1p5b
fi
grep -h -A24 "exact on GPU\|exact probe" "$OUT/test_gpu_exact.log" 2>/dev/null | grep -v "^--$" | head -40
grep -h "^exact overhead\|^rollout vs actor" "$OUT/bench_pair.log" 2>/dev/null
grep -h "by step:" "$OUT/seeded_pair.log" "$OUT/refits_1p5b.log" 2>/dev/null
finish gpu_exact
