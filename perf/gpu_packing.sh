#!/usr/bin/env bash
# Packed vs padded actor updates on the lengths of a real GSM8K run (issue 21), one H200, from the repo root:
#   bash perf/gpu_packing.sh
#
# Needs what perf/gpu_dapo.sh needs: the vLLM wheels (perf/install_wheels.sh: chunks uploaded to /tmp/whl, .whl
# carried; skipped on a kept machine where they import), the SmolLM2-135M GGUF (SMOL_GGUF, default
# /tmp/smol.gguf, else joined from /tmp/smol.gguf.part-aa and -ab) and GSM8K (GSM8K_DIR with train.jsonl, default
# /tmp/gsm8k, else the carried .gpu/smol/p2/gsm8k). Stages:
#   1. install, build: the wheels into /tmp/site, megarl._C (both skipped when already done);
#   2. gsm8k: parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml for 3 GRPO steps with the actor's passes packed
#      (actor.sequence_packing=true, 32k tokens a micro-batch: the packed trainer on the GPU), at most 512 new
#      tokens (a context of 896), every sample logged: $OUT/gsm8k/samples.jsonl holds 1,536 real (prompt_tokens,
#      length) pairs of SmolLM2 answering GSM8K;
#   3. bench: python -m megarl.bench.packing on the Qwen2.5-1.5B shape (bf16, random weights) over 256 sequences
#      drawn from those lengths (one mini-batch of the config), padded vs packed at 16,384 tokens a micro-batch,
#      mean of 3 updates after a warm-up: $OUT/packing.json, with the real tokens/s of both, their ratio (the
#      issue's target: >= 1.3x) and the peak memory of both.
# The last line is "gpu_packing: PASS" or "gpu_packing: FAIL" (exit status 0 or 1). About 5 minutes once the
# wheels are uploaded.
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension
begin gpu_packing 570

source perf/gpu_smollm2_gsm8k.sh  # SMOL_GGUF, GSM8K_DIR
export RUNS=/tmp/runs DATA=/tmp/data/gsm8k

install_wheels() {
  bash perf/install_wheels.sh
}

gsm8k() {
  rm -rf "$RUNS/packing-gsm8k"
  python3 -m megarl.cli train parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml data.gsm8k_source="$GSM8K_DIR" \
    "data.train_files=[$DATA/train.parquet]" run.output_dir="$RUNS" run.name=packing-gsm8k trainer.steps=3 \
    trainer.save_every=0 trainer.progress=false trainer.report=false trainer.log_samples=512 \
    validation.enabled=false rollout.max_new_tokens=512 rollout.max_model_len=896 rollout.enforce_eager=true \
    actor.sequence_packing=true || return 1
  mkdir -p "$OUT/gsm8k"
  for f in metrics.jsonl samples.jsonl; do
    [ -f "$RUNS/packing-gsm8k/$f" ] && cp "$RUNS/packing-gsm8k/$f" "$OUT/gsm8k/"
  done
  python3 - "$OUT/gsm8k" <<'EOF'
import json
import sys
from pathlib import Path

import numpy as np

run = Path(sys.argv[1])
samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
response = np.array([s["length"] for s in samples])
prompt = np.array([s["prompt_tokens"] for s in samples])
for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
    print(f"step {m['step']}: reward {m['reward/mean']:.3f}, actor update {m['time/actor_update']:.2f} s "
          f"(packed), step {m['time/step']:.2f} s")
print(f"{len(samples)} samples: prompt tokens mean {prompt.mean():.0f} (max {prompt.max()}), response tokens mean "
      f"{response.mean():.0f}, median {np.median(response):.0f}, p90 {np.percentile(response, 90):.0f}, max "
      f"{response.max()}; cut at 512: {np.mean(response >= 512):.1%}")
assert len(samples) == 3 * 512, f"{len(samples)} samples logged, expected 1536"
EOF
}

bench() {
  python3 -m megarl.bench.packing --model qwen2.5-1.5b --lengths "$OUT/gsm8k/samples.jsonl" --rows 256 \
    --budget 16384 --steps 3 --out "$OUT/packing.json" > /dev/null || return 1
  python3 - "$OUT/packing.json" <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
for mode in ("padded", "packed"):
    m = r[mode]
    print(f"{mode}: {m['micro_batches']} micro-batches, {m['padded_tokens']} tokens run for {m['real_tokens']} real, "
          f"{m['tokens_per_s']:.0f} real tokens/s, {m['seconds']:.3f} s an update, peak "
          f"{m['peak_memory_bytes'] / 2**30:.1f} GiB")
print(f"packed / padded real tokens/s: {r['packed_speedup']:.2f}x (target >= 1.3x: "
      f"{'met' if r['packed_speedup'] >= 1.3 else 'missed'})")
EOF
}

export -f install_wheels build_extension gsm8k bench

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 200 build_extension
[ $failed -eq 0 ] && stage gsm8k 300 gsm8k
[ $failed -eq 0 ] && stage bench 240 bench
cat "$OUT"/gsm8k.log "$OUT"/bench.log 2>/dev/null | grep -E "^(step|[0-9]+ samples|padded|packed)"
finish gpu_packing
