#!/usr/bin/env bash
# The multi-GPU runs of one machine kind, one command each (docs/performance.md, "Multi-GPU runs"):
#   bash bench/multi_gpu.sh nvidia-h100-x2 | nvidia-h100-x4 | nvidia-h100-x8   (or nvidia-h200-x2/x4/x8)
# Further arguments go to bench/multi_gpu.py (e.g. --parts correctness,dtensor). The record,
# <device>-multigpu-<N>.json, goes to $OUT where it is set (the device machine's folder that comes
# back; copy it into docs/perf), else to docs/perf; the log beside it.
set -euo pipefail
case "${1:-}" in
  nvidia-h100-x2 | nvidia-h200-x2) N=2 ;;
  nvidia-h100-x4 | nvidia-h200-x4) N=4 ;;
  nvidia-h100-x8 | nvidia-h200-x8) N=8 ;;
  *) echo "usage: $0 nvidia-h100-x2|nvidia-h100-x4|nvidia-h100-x8 (or nvidia-h200-x2/x4/x8) [multi_gpu.py args]" >&2
     exit 2 ;;
esac
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# NVLink multicast off, for every process torchrun starts (the device machines' rule)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-docs/perf}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# the script's own watchdog ends a stuck run at 540 s (MGPU_WATCHDOG), inside the 10-minute limit,
# leaving the record of the parts it finished
python3 -m torch.distributed.run --standalone --nproc_per_node "$N" bench/multi_gpu.py --out "$out" "$@" \
  2>&1 | tee "$out/multigpu-$N.log"
