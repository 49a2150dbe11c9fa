# Sourced by the GPU perf scripts (gpu_rl_step, gpu_memory_estimate, gpu_offload, gpu_resume) with OUT set: the
# environment of a GPU machine without network (the wheels installed into /tmp/site when missing:
# perf/install_wheels.sh), the megarl._C extension (perf/build_C.sh) and the synthetic task of
# tests/rl_tasks.py in $OUT: its word-level tokenizer ($OUT/tok) and 4096 prompts ($OUT/prompts.jsonl).
source perf/gpu_env.sh
mkdir -p "$OUT"
bash perf/install_wheels.sh
bash perf/build_C.sh
python3 -c "
from pathlib import Path
from tests.rl_tasks import make_tiny_model, write_prompts
make_tiny_model(Path('$OUT/tok')); write_prompts(Path('$OUT/prompts.jsonl'), 4096)"
