#!/usr/bin/env bash
# A client on several GPUs (NCCL): what each rank holds and a step's time, DDP against FSDP,
# at Llama-3-8B block shapes (benchmarks/distributed_client.py), for N = 1, 2, ... up to
# the GPUs visible. Prepared for a multi-GPU machine; not run on the CPU dev machine (it
# has no GPU: docs/LARGE_MODELS.md, "A client on several processes").
#   bash benchmarks/gpu_distributed.sh [OUT_DIR] [BLOCKS]
# Needs the package installed (README) with a CUDA build of torch. One rank per GPU
# (NCCL refuses two ranks on one device), so N stops at the GPU count.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_distributed}}
BLOCKS=${2:-4}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_distributed: no CUDA GPU visible to torch; nothing to measure" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
NS=1
n=2
while [ "$n" -le "$GPUS" ]; do NS="$NS,$n"; n=$(( n * 2 )); done
echo "== N = $NS, $BLOCKS block(s), dense fp32 side branch =="
python benchmarks/distributed_client.py --device cuda --nprocs "$NS" --blocks "$BLOCKS" \
  --tokens 512 --batch 8 --steps 5 --json "$OUT/distributed_dense.json" | tee "$OUT/dense.md"
echo "== the same with a rank-64 side branch (a few rounds' worth) =="
python benchmarks/distributed_client.py --device cuda --nprocs "$NS" --blocks "$BLOCKS" \
  --side 64 --tokens 512 --batch 8 --steps 5 --json "$OUT/distributed_r64.json" \
  | tee "$OUT/r64.md"
# Exactness of a client on two GPUs, end to end, where the CPU machine cannot check it:
# a 4-bit (nf4, bitsandbytes) and a bf16 base under DDP (NCCL), MiniLM on BBC News,
# 2 clients x 2 processes, 2 rounds; verify_export.py rebuilds the ideal from the saved
# client adapters in fp64 and exits 1 when the export is not exact.
if [ "$GPUS" -ge 2 ]; then
  for prec in "--quantization nf4" "--dtype bf16"; do
    tag=$(echo "$prec" | tr -d ' -')
    echo "== exactness, 2 processes per client (DDP, NCCL), $prec =="
    # shellcheck disable=SC2086
    fedexlora run --method fedex --num-clients 2 --rounds 2 --local-steps 4 --max-train 400 \
      --max-test 100 $prec --device cuda --nproc-per-client 2 --distributed ddp \
      --save-client-adapters --export "$OUT/export-$tag" --out "$OUT/run-$tag" --no-progress
    python benchmarks/verify_export.py "$OUT/run-$tag" "$OUT/export-$tag" | tee "$OUT/exact-$tag.txt"
  done
fi
