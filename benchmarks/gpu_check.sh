#!/usr/bin/env bash
# The device check in one command (about 10 minutes on one H100; nothing downloads):
#   1. the tests that use a CUDA device (they skip on a CPU-only machine),
#   2. benchmarks/gpu_check.py: per-method tokens/s and peak memory on a random ~1B Llama in
#      bf16 with gradient checkpointing, the same workload in TRL's SFTTrainer, QLoRA on the
#      same model, and the memory plan beside every measured peak.
# Results: benchmarks/results/gpu/{cuda_tests.txt,gpu_check.json}.
#   benchmarks/gpu_check.sh --dry-run    the same on a CPU with a tiny shape, in seconds
# Any other argument goes to gpu_check.py (e.g. --methods seq_ft,ewc --steps 5).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then python="$here/../.venv/bin/python"; else python=python3; fi
fi
out="$here/results/gpu"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--dry-run" ]; then
  exec env CUDA_VISIBLE_DEVICES= "$python" "$here/gpu_check.py" --dry-run --out "$out/gpu_check_dry_run.json" "${@:2}"
fi
# The CUDA tier: every test that asks for a CUDA device (selected by name; each skips without one).
(cd "$here/.." && timeout 180 "$python" -m pytest -q -p no:cacheprovider \
  tests/integration/test_qlora.py tests/integration/test_real_model_checks.py -k "cuda or 4bit or gpu" \
  -rs) 2>&1 | tee "$out/cuda_tests.txt" || echo "the CUDA tests failed: see $out/cuda_tests.txt"
exec timeout 540 "$python" "$here/gpu_check.py" --out "$out/gpu_check.json" "$@"
