#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU, runs a short bf16 federated job on the embedded
# model and the aggregation benchmark on the GPU, offline, and prints their figures.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# Needs the package installed (README) with a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0

python - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA GPU visible to torch; nothing to check")
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__,
      "| cuda", torch.version.cuda)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== bf16 federated job (minilm, bbc-news, fedex vs fedit, 3 rounds) =="
start=$(date +%s)
fedexlora run --device cuda --dtype bf16 --method fedex,fedit --rounds 3 --local-epochs 1 \
  --batch-size 32 --max-length 128 --no-progress --out "$OUT/federated"
echo "wall seconds: $(( $(date +%s) - start ))"
python - "$OUT/federated/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['method']:6s} round {r['round']}: accuracy {r['metrics']['accuracy']:.4f} "
          f"seconds {r['seconds']:.1f} effective deviation {r['effective_deviation']['max']:.1e}")
PY

echo "== aggregation benchmark on the GPU =="
python benchmarks/aggregation.py --device cuda --json "$OUT/aggregation.json"

echo "== short paper-glue-roberta-base (SST-2 only, 3 rounds), when the hub is reachable =="
if HF_HUB_OFFLINE=0 python -c "
import huggingface_hub as h; h.model_info('FacebookAI/roberta-base'); h.dataset_info('nyu-mll/glue')
" >/dev/null 2>&1; then
  HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 fedexlora run --recipe paper-glue-roberta-base \
    --task glue/sst2 --rounds 3 --local-epochs 1 --device cuda --dtype bf16 --no-progress \
    --out "$OUT/glue-sst2"
  # the paper's figure is the 6-task average: SST-2 alone is printed beside it for scale
  sed -n '/## Paper beside this run/,/^- /p' "$OUT/glue-sst2/summary.md"
else
  echo "skipped: the Hugging Face hub is not reachable from here"
fi
