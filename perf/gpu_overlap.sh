#!/usr/bin/env bash
# The overlap of generation with scoring (issue 47, rollout.overlap_scoring: megarl/rollout/overlap.py) on SmolLM2
# GSM8K at 512 new tokens, one H100 or H200, from the repo root:   bash perf/gpu_overlap.sh
#
# Needs what perf/gpu_packing.sh needs: the vLLM wheels (perf/install_wheels.sh: chunks uploaded to /tmp/whl, .whl
# carried; skipped on a kept machine where they import), the SmolLM2-135M GGUF (SMOL_GGUF, default
# /tmp/smol.gguf, else joined from /tmp/smol.gguf.part-aa and -ab) and GSM8K (GSM8K_DIR with train.jsonl, default
# /tmp/gsm8k, else the carried .gpu/smol/p2/gsm8k). Stages:
#   1. install, build: the wheels into /tmp/site, megarl._C (both skipped when already done);
#   2. sequential: parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml for STEPS (default 4) GRPO steps at most 512 new
#      tokens (a context of 896), validation off: generate, then rewards, old and reference log-probs, update;
#   3. overlap: the same run with rollout.overlap_scoring=true (the finished groups' rewards and log-probs while
#      the others generate), back to back on this machine;
#   4. compare: every metric of every step but the timings (time/, throughput/, pool/, overlap/, offload/,
#      reshard/, perf/, mfu/, memory/) equal in both runs (else the keys that differ and by how much), and the
#      step time of both (mean of the steps after the first) with the phases it moved: generate, reward,
#      old_logprobs, reference (with the overlap: overlap_frames, the units' results laid out); overlap/units,
#      overlap/early_units (units scored before the last sample), overlap/scoring_s and overlap/wait_s
#      (the wait for the last units after it). $OUT/overlap.json holds the figures, $OUT/overlap-sequential and
#      $OUT/overlap-overlap the runs' records.
# The last line is "gpu_overlap: PASS" (identical metrics) or "gpu_overlap: FAIL". About 5 minutes once the wheels
# are uploaded.
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension
begin gpu_overlap 570

source perf/gpu_smollm2_gsm8k.sh  # SMOL_GGUF, GSM8K_DIR
export RUNS=/tmp/runs DATA=/tmp/data/gsm8k STEPS=${STEPS:-4}

run() {  # run NAME OVERLAP: the config's GRPO steps at 512 new tokens
  rm -rf "$RUNS/overlap-$1"
  python3 -m megarl.cli train parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml data.gsm8k_source="$GSM8K_DIR" \
    "data.train_files=[$DATA/train.parquet]" run.output_dir="$RUNS" run.name="overlap-$1" trainer.steps="$STEPS" \
    trainer.save_every=0 trainer.progress=false trainer.report=false validation.enabled=false \
    rollout.max_new_tokens=512 rollout.max_model_len=896 rollout.overlap_scoring="$2" || return 1
  copy_run "overlap-$1"
}
sequential() { run sequential false; }
overlap() { run overlap true; }

compare() {
  python3 - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
timed = ("time/", "throughput/", "pool/", "overlap/", "offload/", "reshard/", "perf/", "mfu/", "memory/")
runs = {name: [json.loads(line) for line in (out / f"overlap-{name}" / "metrics.jsonl").read_text().splitlines()
               if line.strip()] for name in ("sequential", "overlap")}
seq, ovl = runs["sequential"], runs["overlap"]
assert len(seq) == len(ovl) > 1, f"{len(seq)} and {len(ovl)} steps logged"
differ = {}
for a, b in zip(seq, ovl):
    for k, v in a.items():
        if not k.startswith(timed) and b.get(k) != v:
            differ.setdefault(k, []).append((a["step"], v, b.get(k)))
def mean(rows, key):
    values = [m.get(key, 0.0) for m in rows[1:]]  # the first step warms up (graphs, allocator)
    return sum(values) / len(values)
phases = ("step", "generate", "reward", "old_logprobs", "reference", "overlap_frames", "actor_update")
report = {name: {p: mean(rows, f"time/{p}") for p in phases} for name, rows in runs.items()}
report["overlap"].update({k: mean(ovl, f"overlap/{k}") for k in ("units", "early_units", "scoring_s", "wait_s")})
report["speedup"] = report["sequential"]["step"] / report["overlap"]["step"]
report["identical"] = not differ
report["differ"] = {k: v[:3] for k, v in differ.items()}
(out / "overlap.json").write_text(json.dumps(report, indent=1))
for name in ("sequential", "overlap"):
    print(f"{name}: " + ", ".join(f"{p} {report[name][p]:.2f} s" for p in phases))
o = report["overlap"]
print(f"overlap: {o['units']:.0f} units a step, {o['early_units']:.1f} before the last sample, scoring thread "
      f"{o['scoring_s']:.2f} s, wait after the last sample {o['wait_s']:.2f} s")
for k, v in differ.items():
    print(f"DIFFERS {k}: " + "; ".join(f"step {s}: {x!r} vs {y!r}" for s, x, y in v[:3]))
print(f"step time {report['sequential']['step']:.2f} s -> {report['overlap']['step']:.2f} s "
      f"({report['speedup']:.2f}x), metrics {'identical' if not differ else f'differ in {len(differ)} keys'}")
sys.exit(1 if differ else 0)
EOF
}

export -f install_wheels build_extension copy_run run sequential overlap compare

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 200 build_extension
[ $failed -eq 0 ] && stage sequential 240 sequential
[ $failed -eq 0 ] && stage overlap 240 overlap
[ $failed -eq 0 ] && stage compare 60 compare
cat "$OUT"/compare.log 2>/dev/null
finish gpu_overlap
