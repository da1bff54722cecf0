#!/usr/bin/env bash
# The gpu-marked tests, then measured vs predicted on one CUDA GPU: 9 plans of a 1B model
# (full / LoRA / QLoRA, checkpointing on, off and op-level, micro-batch 1 and 2), each a real short
# run launched by the measured evaluator; the table goes to benchmarks/results/.
#
#   bash benchmarks/gpu_check.sh [MODEL] [SEQ_LEN]      (default: llama-3.2-1b 2048)
#
# Needs: torch with CUDA, transformers, peft, bitsandbytes, accelerate, deepspeed and
# autofit importable (the machine may have no network: install from wheels brought along,
# e.g. `pip install --no-index --find-links wheels/ -e .`). Status: prepared, NOT yet run
# on a GPU (written on a machine without one).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-llama-3.2-1b}"
SEQ="${2:-2048}"
PY="${PYTHON:-python}"

"$PY" - <<'PYCHECK'
import importlib, sys
missing = [m for m in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "deepspeed", "optuna",
                       "sqlalchemy", "autofit") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing packages: {', '.join(missing)} (install them from the wheels you brought)")
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible to torch")
print("GPU:", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
PYCHECK

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the GPU tests first (measured vs simulated on a small model, a few minutes)
timeout 300 "$PY" -m pytest -q -m gpu tests/evaluators/test_gpu.py || echo "gpu tests: FAILED (see above)"
timeout 580 "$PY" benchmarks/measured_vs_predicted.py --model "$MODEL" --seq-len "$SEQ" --global-batch 8 \
    --trial-timeout 120 --db "sqlite:///benchmarks/results/measured.db"
