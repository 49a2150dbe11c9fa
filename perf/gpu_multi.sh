#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), one command from the repo root, within 10 minutes:   bash perf/gpu_multi.sh
#
# Carry .whl (megatron-core and omegaconf wheels, as for perf/gpu_vllm.sh). For part (b) the vLLM 0.24.0 wheels
# must already be in /tmp/whl on this machine (gpu_vllm.sh's header says how); without them (b) is skipped.
#   1. installs the wheels into /tmp/site (skipped where they already import) and builds megarl._C (CUDA);
#   2. (a) the reshard of the Qwen2.5-7B shape (bf16), Megatron TP=2 -> vLLM TP=1 on both GPUs, with 16 and
#      256 MiB buckets and both baselines in each run, plus 256 MiB with every piece staged (--no-direct), and
#      Megatron TP=1 x DP=2 -> vLLM TP=2; JSON per run in $OUT/bench_*.json, then the issue's must-show checks
#      (exact, <= 25 ms at <= 256 MiB, >= 2x faster than both baselines, 16 MiB within 1.5x of 256 MiB,
#      staging <= 2 buckets, bytes received = the rank's missing half) in $OUT/reshard_summary.json;
#   3. (b) tests/test_gpu_vllm_tp.py: Megatron TP=2 -> vLLM TP=1 x 2 and TP=1 x DP=2 -> vLLM TP=2 against the
#      one-GPU run on the same weights (greedy output, sampled-token log-probs vs the actor) -> $OUT/gpu_vllm_tp.json.
# Each stage prints PASS or FAIL (with its log's tail); the last line is "gpu_multi: PASS" or "gpu_multi: FAIL".
# ONLY=reshard_bench or ONLY=vllm_tp runs one part (when installing vLLM leaves too little of the 10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish
begin gpu_multi 570

install_wheels() {  # vLLM too where its wheels were uploaded (perf/install_wheels.sh), else megatron-core alone
  bash perf/install_wheels.sh && return 0
  echo "no vLLM: part (b) is skipped; installing the wheels of .whl/ alone"
  python3 -c "import megatron.core, omegaconf" 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl || return 1
  python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)"
}

build_extension() {  # megarl._C with its CUDA kernels
  bash perf/build_C.sh && python3 -c "import torch, megarl._C; assert megarl._C.cuda, 'megarl._C was built without CUDA'"
}

bench() {  # bench NAME ARGS...: one reshard benchmark, JSON to $OUT/bench_NAME.json
  local name=$1; shift
  python3 -m megarl.cli bench reshard --model "${MODEL:-qwen2.5-7b}" --layers "${LAYERS:-0}" --dtype bf16 --nproc 2 \
    --dst vllm --iters 5 --ranks-per-node 2 --json "$OUT/bench_$name.json" --overwrite "$@"
}

reshard_bench() {
  bench tp2_vllm1_b256 --src-tp 2 --dst-tp 1 --bucket-mb 256 || return 1
  bench tp2_vllm1_b16 --src-tp 2 --dst-tp 1 --bucket-mb 16 || return 1
  bench tp2_vllm1_b256_staged --src-tp 2 --dst-tp 1 --bucket-mb 256 --no-direct --no-baselines || return 1
  bench tp1dp2_vllm2_b256 --src-tp 1 --dst-tp 2 --bucket-mb 256 --no-baselines || return 1
  python3 - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {p.stem[len("bench_"):]: json.loads(p.read_text()) for p in sorted(out.glob("bench_*.json"))}

def wall(run, method):  # the slowest rank's median
    return max(r["methods"][method]["wall_s"] for r in run["ranks"])

b256, b16 = runs["tp2_vllm1_b256"], runs["tp2_vllm1_b16"]
t256, t16 = wall(b256, "reshard"), wall(b16, "reshard")
rank0 = b256["ranks"][0]["methods"]["reshard"]
checks = {
    "exact": all(m["exact"] for run in runs.values() for r in run["ranks"] for m in r["methods"].values()),
    "tp2->vllm1 256 MiB <= 25 ms": t256 <= 0.025,
    "GB/s per rank (received) >= 300": rank0["bytes_received"] / t256 / 1e9 >= 300,
    ">= 2x faster than gather_full": wall(b256, "gather_full") >= 2 * t256,
    ">= 2x faster than per_tensor_allgather": wall(b256, "per_tensor_allgather") >= 2 * t256,
    "16 MiB within 1.5x of 256 MiB": t16 <= 1.5 * t256,
    "staging <= 2 buckets": all(r["methods"]["reshard"]["peak_staging_bytes"] <= 2 * run["config"]["bucket_mb"] * 2**20
                                for run in runs.values() for r in run["ranks"]),
    "bytes received = the missing half": all(
        abs(r["methods"]["reshard"]["bytes_received"] - r["src_bytes"]) <= 0.01 * r["src_bytes"]
        for run in (b256, b16) for r in run["ranks"]),
}
table = {name: {m: {"wall_ms": wall(run, m) * 1e3,
                    "recv_GBps": run["ranks"][0]["methods"][m]["bytes_received"] / wall(run, m) / 1e9}
                for m in run["ranks"][0]["methods"]} for name, run in runs.items()}
for name, run in runs.items():
    r = run["ranks"][0]["methods"]["reshard"]
    table[name]["reshard"].update(rounds=r["rounds"], direct=r.get("direct"), staged_MB=r.get("bytes_staged", 0) / 1e6,
                                  staging_MB=r["peak_staging_bytes"] / 1e6, phases_ms={k: v * 1e3 for k, v in r["phases_s"].items()})
summary = {"table": table, "checks": checks}
(out / "reshard_summary.json").write_text(json.dumps(summary, indent=1))
for name, methods in table.items():
    for m, row in methods.items():
        print(f"{name:<24} {m:<21} {row['wall_ms']:8.1f} ms  {row['recv_GBps']:7.1f} GB/s received per rank"
              + (f"  rounds {row['rounds']}, staged {row['staged_MB']:.0f} MB, staging {row['staging_MB']:.0f} MB"
                 if m == "reshard" else ""))
for k, v in checks.items():
    print(f"{'ok ' if v else 'NOT'} {k}")
print(f"reshard TP2 -> vLLM TP1: {t256 * 1e3:.1f} ms at 256 MiB, {t16 * 1e3:.1f} ms at 16 MiB; "
      f"{sum(checks.values())}/{len(checks)} checks met")
sys.exit(0 if checks["exact"] else 1)
PY
}

vllm_tp() {
  python3 -c "import vllm" 2>/dev/null || { echo "skipped: no vllm wheels in /tmp/whl"; return 0; }
  python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_vllm_tp.py
}

export -f install_wheels build_extension bench reshard_bench vllm_tp

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 150 build_extension
if [ $failed -eq 0 ]; then
  case "${ONLY:-all}" in all|reshard_bench) stage reshard_bench 240 reshard_bench;; esac
  case "${ONLY:-all}" in all|vllm_tp) stage vllm_tp 300 vllm_tp;; esac
fi
grep -hE "^(ok |NOT)|ms  " "$OUT/reshard_bench.log" 2>/dev/null
grep -h "log-prob |vLLM - actor|" "$OUT/vllm_tp.log" 2>/dev/null
finish gpu_multi
