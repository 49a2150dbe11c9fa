# Sourced by the GPU scripts that run the SmolLM2 GSM8K configs (gpu_bench_step.sh's smollm2 case, gpu_dapo.sh,
# gpu_packing.sh), from the repo root: finds the SmolLM2-135M GGUF (SMOL_GGUF, default /tmp/smol.gguf, else
# joined from its uploaded pieces: perf/gpu_lib.sh's smol_gguf) and GSM8K (GSM8K_DIR with train.jsonl, default
# /tmp/gsm8k, else /tmp/sm/gsm8k of the slices' uploads, else the carried .gpu/smol/p2/gsm8k), and exports both;
# ends the script, naming what to upload, when either is missing.
GSM8K_DIR=${GSM8K_DIR:-/tmp/gsm8k}
declare -F smol_gguf >/dev/null || source perf/gpu_lib.sh  # (gpu_bench_step.sh does not source it)
smol_gguf  # the two uploads of .gpu/smol
[ -f "$GSM8K_DIR/train.jsonl" ] || [ ! -f /tmp/sm/gsm8k/train.jsonl ] || GSM8K_DIR=/tmp/sm/gsm8k
[ -f "$GSM8K_DIR/train.jsonl" ] || [ ! -f .gpu/smol/p2/gsm8k/train.jsonl ] || GSM8K_DIR=$PWD/.gpu/smol/p2/gsm8k
[ -f "$SMOL_GGUF" ] || { echo "no $SMOL_GGUF: upload the SmolLM2 GGUF (GPU.md) or set SMOL_GGUF"; exit 1; }
[ -f "$GSM8K_DIR/train.jsonl" ] || { echo "no $GSM8K_DIR/train.jsonl: carry GSM8K or set GSM8K_DIR"; exit 1; }
export SMOL_GGUF GSM8K_DIR
