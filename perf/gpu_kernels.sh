#!/usr/bin/env bash
# The training-phase kernels (kernels/) on one H200, in one command from the repo root (carry .whl):
#   bash perf/gpu_kernels.sh
# 1. installs the megatron-core and omegaconf wheels of .whl/ into /tmp/site (no vLLM needed; skipped when they
#    import from there already);
# 2. runs the GPU tests of kernels/ (tests/test_gpu_kernels.py: Triton kernels vs torch ops, bf16 actor with the
#    kernels vs the plain actor; prints the bf16 differences);
# 3. perf/bench_models.py, actor forward+backward in bf16 (loss -mean(log-prob) - 0.01 mean(entropy)) for the
#    Qwen2.5-0.5B shape at 8 x 2048 tokens (targets: MFU >= 30%, peak <= 40 GiB) and Qwen2.5-1.5B at 4 x 2048
#    (target: MFU >= 40%), each four ways: kernels off (local attention, full logits), SDPA attention only,
#    chunked log-probs only, both on; the last two also run the plain path on the same weights and report the
#    bf16 differences (--compare-plain). MFU is against 989 TFLOP/s (datasheet dense bf16). A run out of
#    memory is recorded as such.
# All runs in one JSON, $OUT/gpu_kernels.json (default runs/gpu_kernels), and a table; the last line is
# "gpu_kernels: PASS|FAIL (N s)".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_kernels}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source perf/gpu_env.sh
START=$SECONDS
failed=0

if ! python3 -c "import megatron.core, omegaconf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu_kernels: FAIL (wheels of .whl/ did not install: carry .whl)"; exit 1; }
fi
python3 -c "import torch, triton, megatron.core; print('torch', torch.__version__, '| triton', triton.__version__, \
'| megatron-core', megatron.core.__version__, '|', torch.cuda.get_device_name())"

python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_kernels.py 2>&1 | grep -v -i warn \
  | tee "$OUT/test_gpu_kernels.log" | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

RUNS=/tmp/gpu_kernels_runs
rm -rf "$RUNS" && mkdir -p "$RUNS"
bench() {  # NAME ARGS...: one bench_models.py run; a run out of memory is a result, not a failure
  local name=$1; shift
  python3 perf/bench_models.py --steps 5 --json "$RUNS/$name.json" "$@" > "$RUNS/$name.log" 2>&1
  [ -f "$RUNS/$name.json" ] || { echo "$name: FAIL"; tail -20 "$RUNS/$name.log"; cp "$RUNS/$name.log" "$OUT/"; failed=1; }
}
for shape in "qwen2.5-0.5b 8" "qwen2.5-1.5b 4"; do
  set -- $shape
  bench "$1_1off" --model "$1" --micro-batch "$2" --seq 2048 --attention local --no-chunked-logprob
  bench "$1_2sdpa" --model "$1" --micro-batch "$2" --seq 2048 --attention sdpa --no-chunked-logprob
  bench "$1_3chunked" --model "$1" --micro-batch "$2" --seq 2048 --attention local --chunked-logprob --compare-plain
  bench "$1_4both" --model "$1" --micro-batch "$2" --seq 2048 --attention sdpa --chunked-logprob --compare-plain
done
python3 - "$RUNS" "$OUT/gpu_kernels.json" <<'EOF'
import json
import sys
from pathlib import Path

runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))]
Path(sys.argv[2]).write_text(json.dumps(runs, indent=2))
for r in runs:
    line = (f"{r['model']:13s} {r['micro_batch']} x {r['seq']}  attention={r['attention']:5s} "
            f"chunked_logprob={str(r['chunked_logprob']):5s}  ")
    if r["status"] != "ok":
        print(line + r["status"])
        continue
    print(line + f"{r['seconds_per_fwd_bwd_median']:.3f} s  MFU {r['mfu']:.1%}  peak {r['peak_memory_gib']:.1f} GiB")
    c = r.get("compare_plain")
    if c:
        print(f"    vs plain (bf16, {c['rows']} rows): |d logprob| max {c['max_abs_diff_logprobs']:.4f} mean "
              f"{c['mean_abs_diff_logprobs']:.5f}, |d entropy| max {c['max_abs_diff_entropy']:.4f}, grad rel "
              f"{c['max_rel_diff_grad']:.4f} ({c['max_rel_diff_grad_param']}); Triton vs torch ops: "
              f"{c.get('max_abs_diff_logprobs_triton_vs_torch')}")
EOF

[ $failed -eq 0 ] && echo "gpu_kernels: PASS ($(( SECONDS - START )) s)" && exit 0
echo "gpu_kernels: FAIL ($(( SECONDS - START )) s)"
exit 1
