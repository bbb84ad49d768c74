#!/usr/bin/env bash
# Prepared GPU check (not part of CI): the trainer on one NVIDIA GPU, bf16, the "gpt-1.3b" preset
# (GPT-3 XL shape, 1.42B parameters with the untied head), seq 2048, tp1 pp1 dp1.
#   bash tests/gpu/check_gpu.sh            # from the repo root, with a python that has CUDA torch
# Prints one line per run: tokens/s, TFLOP/s per GPU, MFU (target >= 45 %), peak memory.
# Multi-rank layouts need several GPUs (NCCL refuses two ranks on one GPU). Budget: < 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
# Overridable for a smoke test of this script on CPU: DEVICE=cpu DTYPE=fp32 MODEL=gpt-tiny
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bf16} MODEL=${MODEL:-gpt-1.3b}
OUT_DIR=${OUT:-$(mktemp -d)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, "on", torch.cuda.get_device_name())' || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
fi

run() {  # name, micro_batch_size, activation_checkpoint, compile
  local name=$1 cfg="$OUT_DIR/$1.config.json" out="$OUT_DIR/$1.result.json"
  cat >"$cfg" <<JSON
{"model": "$MODEL", "parallel": {"micro_batch_size": $2, "activation_checkpoint": "$3"},
 "warmup_steps": 3, "measure_steps": 10, "device": "$DEVICE", "dtype": "$DTYPE", "compile": $4}
JSON
  timeout 240 "$PY" -m trainer.benchmark --config "$cfg" --out "$out" >"$OUT_DIR/$name.log" 2>&1
  "$PY" - "$name" "$out" <<'PYEOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
try:
    r = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"{name:<22} no result ({e}); see {path.replace('.result.json', '.log')}")
    sys.exit()
if r["status"] != "ok":
    print(f"{name:<22} {r['status']}: {r['error'].strip().splitlines()[-1] if r['error'] else ''}")
    sys.exit()
st = sorted(r["step_times_s"])
print(f"{name:<22} {r['tokens_per_s']:>9.0f} tokens/s  {r['model_tflops_per_device']:6.1f} TFLOP/s  "
      f"MFU {r['mfu']:6.1%} (peak {r['peak_tflops_per_device']:.0f})  median step {st[len(st)//2]*1e3:6.1f} ms  "
      f"peak mem {r['peak_memory_bytes']/2**30:5.1f} GiB  loss {r['losses'][0]:.2f}->{r['losses'][-1]:.2f}")
PYEOF
}

run mbs4 4 none false
run mbs4-full-ckpt 4 full false
run mbs8 8 none false
run mbs8-compiled 8 none true
