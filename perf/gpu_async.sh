#!/usr/bin/env bash
# Asynchronous RL on split GPU pools (issue 19), two H200s (nvidia-h200-x2):   bash perf/gpu_async.sh CASE
# `megarl bench step` of the Qwen2.5-1.5B shape (random weights, bf16), GRPO with a reference, 64 prompts x 8
# samples = 512 samples of at most 256 new tokens, vLLM with CUDA graphs; one JSON per case in $OUT (default
# runs/gpu_async) and its table (per phase seconds, tokens/s/GPU, the pools' busy/idle seconds):
#   colocated   both GPUs do everything, one after the other (actor + reference TP=1 x DP=2, one vLLM engine
#               per GPU; trainer.mode=sync)
#   split-sync  GPU 0 trains (actor + reference + reward), GPU 1 generates (vLLM, placement.rollout on rank 1):
#               trainer.mode=sync, each batch generated with the weights of the step before
#   split-async the same pools with trainer.mode=async trainer.max_staleness=1 (one-step-off), with the
#               rollout correction (algorithm.rollout_correction.preset=token_tis) async runs should use
#   summary     the three JSONs side by side in $OUT/async_summary.json and on the console, with the issue's
#               target (split async >= 1.3x split sync, tokens/s/GPU) and the comparison to colocated
# Installs the wheels (perf/install_wheels.sh) and builds megarl._C (perf/build_C.sh) first; each case starts
# vLLM once (~1 min) and fits one 10-minute call (3 measured steps after 1 warm-up). Run the three cases, then
# summary, in one session (the same machine and clocks). The last line is "gpu_async CASE: PASS|FAIL (N s)".
set -uo pipefail
cd "$(dirname "$0")/.."
CASE=${1:?usage: bash perf/gpu_async.sh CASE [key=value ...] (CASE: colocated split-sync split-async summary)}
shift
OUT=${OUT:-runs/gpu_async}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source perf/gpu_env.sh  # NVLink multicast off; vLLM in-process, offline
START=$SECONDS

if [ "$CASE" = summary ]; then
  python3 - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {c: json.loads((out / f"{c}.json").read_text()) for c in ("colocated", "split-sync", "split-async")
        if (out / f"{c}.json").exists()}
rows = {}
for case, r in runs.items():
    if r["status"] != "ok":
        rows[case] = {"status": r["status"], "error": r.get("error")}
        continue
    rows[case] = {"step_s": r["step_time_s"], "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                  "phases_s": {p: v["time_s"] for p, v in r["phases"].items()}, "pools": r.get("pools")}
    pools = "; ".join(f"{n} busy {p['busy_s']:.2f} s idle {p['idle_s']:.2f} s" for n, p in (r.get("pools") or {}).items())
    print(f"{case:<12} step {r['step_time_s']:6.2f} s  {r['tokens_per_s_per_gpu']:8.0f} tokens/s/GPU  {pools}")
    print("             " + ", ".join(f"{p} {v['time_s']:.2f}" for p, v in r["phases"].items()))
ok = all(r.get("status", "ok") == "ok" for r in rows.values()) and len(rows) == 3
if ok:
    speed = rows["split-async"]["tokens_per_s_per_gpu"] / rows["split-sync"]["tokens_per_s_per_gpu"]
    vs_colocated = rows["split-async"]["tokens_per_s_per_gpu"] / rows["colocated"]["tokens_per_s_per_gpu"]
    rows["checks"] = {"split async / split sync (tokens/s/GPU)": speed, "target >= 1.3": speed >= 1.3,
                      "split async / colocated (tokens/s/GPU)": vs_colocated}
    print(f"split async / split sync: {speed:.2f}x (target >= 1.3x); split async / colocated: {vs_colocated:.2f}x")
(out / "async_summary.json").write_text(json.dumps(rows, indent=1))
sys.exit(0 if ok else 1)
EOF
  rc=$?
  [ $rc -eq 0 ] && echo "gpu_async summary: PASS ($(( SECONDS - START )) s)" && exit 0
  echo "gpu_async summary: FAIL (a case missing or failed)"; exit 1
fi

bash perf/install_wheels.sh > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
bash perf/build_C.sh > "$OUT/build_C.log" 2>&1 || { tail -20 "$OUT/build_C.log"; exit 1; }
[ -f "$OUT/prompts.jsonl" ] || python3 -c "
from pathlib import Path
from tests.rl_tasks import make_tiny_model, write_prompts
make_tiny_model(Path('$OUT/tok')); write_prompts(Path('$OUT/prompts.jsonl'), 4096)" || exit 1

# perf/gpu_bench_step.sh's grpo-1.5b-fast step: 512 samples, <= 256 new tokens, CUDA graphs, kernels/ on
COMMON=(model.path=preset:qwen2.5-1.5b model.tokenizer="$OUT/tok" "data.train_files=[$OUT/prompts.jsonl]"
        data.prepare=null data.use_chat_template=false "data.instruction=''" reward.fn=tests.rl_tasks:says_target
        model.dtype=bfloat16 rollout.engine=vllm rollout.enforce_eager=false trainer.progress=false
        validation.enabled=false run.output_dir="$OUT" run.name="$CASE" data.prompts_per_step=64 rollout.n=8
        rollout.max_new_tokens=256 actor.micro_batch_size=32 actor.logprob_micro_batch_size=64
        actor.ppo_mini_batch_size=256)
# split: GPU 0 trains (actor, reference, reward), GPU 1 generates and may give vLLM most of its memory
SPLIT=("placement.pools.train=[0]" "placement.pools.gen=[1]" placement.actor=train placement.reference=train
       placement.reward=train placement.rollout=gen rollout.gpu_memory_utilization=0.8)
case $CASE in
  colocated)   set -- "${COMMON[@]}" actor.parallel.dp=2 rollout.gpu_memory_utilization=0.35 "$@" ;;
  split-sync)  set -- "${COMMON[@]}" "${SPLIT[@]}" trainer.mode=sync "$@" ;;
  split-async) set -- "${COMMON[@]}" "${SPLIT[@]}" trainer.mode=async trainer.max_staleness=1 \
                 algorithm.rollout_correction.preset=token_tis "$@" ;;
  *) echo "unknown case $CASE (colocated split-sync split-async summary)"; exit 2 ;;
esac
python3 -m megarl.cli bench step "$@" --steps 3 --warmup 1 --json "$OUT/$CASE.json" --overwrite 2>&1 \
  | tee "$OUT/$CASE.log" | grep -v -i -E "warn|^\s*warnings\.warn|INFO"
rc=${PIPESTATUS[0]}
python3 - "$OUT/$CASE.json" <<'EOF' || rc=1
import json
import sys
from pathlib import Path

if not Path(sys.argv[1]).exists():
    sys.exit(f"no report {sys.argv[1]}: bench step stopped before it started (see the log)")
r = json.loads(Path(sys.argv[1]).read_text())
if r["status"] != "ok":
    sys.exit(f"status {r['status']}: {r.get('error')}")
print(f"step {r['step_time_s']:.2f} s, {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, generate "
      f"{r['generate_tokens_per_s']:.0f} tokens/s; pools " + json.dumps(r.get("pools")))
EOF
[ $rc -eq 0 ] && echo "gpu_async $CASE: PASS ($(( SECONDS - START )) s)" && exit 0
echo "gpu_async $CASE: FAIL ($(( SECONDS - START )) s; log $OUT/$CASE.log)"
exit 1
