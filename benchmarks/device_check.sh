#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a session that is lent one (the
# workplace's `device` tool), sized so that its steps' limits (555 s in all) fit one call:
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=570)
#
# There, python3 already holds a CUDA build of PyTorch (the lent H100 runs torch 2.11; and
# transformers, pytest); nothing can be fetched, so unitscale runs from src/ on PYTHONPATH.
# torchao is not installed there: to time its variants, carry a wheel that matches the
# device's torch (torchao 0.14-0.16 pair with torch 2.9-2.11; check torchao's compatibility
# table) into the working tree, e.g. `pip download torchao==<version> --no-deps -d wheels/`
# here, commit nothing, name `wheels` in the run's `carry`, and set
# TORCHAO_WHEEL=wheels/<file>.whl: the preflight installs it with `pip install --no-deps`.
# Without torchao, its variants are recorded as "absent" and the others still run.
#
# In order, each step under its own time limit, a failing step not stopping the next:
#   1. preflight (20 s): CUDA, compute capability >= 8.9, torch's version, torchao
#      importable; written to $OUT/preflight.json. Without CUDA or float8 hardware the
#      script stops there.
#   2. fp8_tests (45 s): tests/transforms/test_to_fp8_cuda.py (odd row counts, 3-D inputs,
#      padding, bf16, autocast, rowwise, delayed scaling on the GPU);
#   3. fp8_step (255 s, compilation included): bench_fp8_step.py --device cuda: tokens/s, peak memory and the
#      converted FLOP share of each variant (bf16 plain and unit-scaled; torchao and to_fp8,
#      tensorwise and rowwise, on the plain model; to_fp8 scaling="none" on the unit-scaled
#      model and on the built-in u-muP decoder), each appended to $OUT/fp8_step.json as
#      soon as it is measured; variants past its 240 s budget are recorded as skipped;
#   3b. fsdp_allgather (15 s): bench_fsdp_allgather.py --device cuda: FSDP2 on one rank
#      (NCCL) with to_fp8's float8 all-gather, "none" and "tensorwise": training equal bit
#      for bit with and without it, the weights that arrived in float8 ($OUT/fsdp_allgather.json);
#   4. the CUDA cases of tests/formats and tests/tracking (`-k cuda`; CI runs the rest);
#   5. bench_formats.py --device cuda (torch.compile(fmt.quantise) for several formats);
#   6. bench_tracking.py --device cuda (bert4, bert2, tiny, gpt2);
#   7. bench_fp8_scaling.py --device cuda: simulate_fp8's scaling="tensorwise"/"delayed"
#      against "none";
#   8. bench_compile_lengths.py --device cuda.
# bench_tracking_zoo.py no longer fits the call: run it alone in a second call,
#
#   run(command="STEPS=tracking_zoo bash benchmarks/device_check.sh", timeout_s=120)
#
# The benchmarks append their CUDA runs to copies of the committed histories in $OUT. Back on
# the development machine: copy $OUT/formats.json, $OUT/tracking.json, $OUT/fp8_scaling.json,
# $OUT/compile_lengths.json, $OUT/tracking_zoo.json, $OUT/fp8_step.json and
# $OUT/fsdp_allgather.json over
# benchmarks/results/, run `python benchmarks/readme_tables.py` (CUDA runs get rows of their
# own; the CPU rows keep coming from the newest CPU runs) and commit.
#
# DEVICE=cpu runs the same steps on the CPU at a tiny size (a dry run of this script, under 5
# minutes; tests/test_device_check.py runs it): the copies are made and appended to as on a
# GPU, with fewer rounds and one model, the FP8 variants eagerly.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
echo "results in $OUT"

if [ "$DEVICE" = cuda ]; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  models=bert4,bert2,tiny,gpt2 rounds=5 formats_numel=24 tests="cuda"
  lengths=16,32,24,64,16,48 archs=llama,gpt2,gptj,bert,t5,mixtral limit_scale=1 fsdp_s=15
else
  models=tiny rounds=2 formats_numel=16 tests="cpu and nearest and not stochastic"
  lengths=16,32,16 archs=llama,bert limit_scale=2  # a shared CPU: twice the limits
  fsdp_s=45  # two processes started on the CPU: 18 s at load 3.5 here (x2: 90 s)
fi
cp benchmarks/results/formats.json benchmarks/results/tracking.json \
  benchmarks/results/fp8_scaling.json "$OUT"/
cp benchmarks/results/compile_lengths.json benchmarks/results/tracking_zoo.json \
  benchmarks/results/fp8_step.json benchmarks/results/fsdp_allgather.json "$OUT"/ 2>/dev/null || true
STEPS=${STEPS:-preflight,fp8_tests,fp8_step,fsdp_allgather,tests,formats,tracking,fp8_scaling,compile_lengths}

status=0
step() {  # step NAME SECONDS COMMAND...: one step's output to $OUT/NAME.log, its status kept
  local name=$1 seconds=$(($2 * limit_scale))
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  echo "=== $name (at most $seconds s) ==="
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc ==="
  [ "$rc" -eq 0 ] || status=1
}

if [ -n "${TORCHAO_WHEEL:-}" ]; then
  "$PYTHON" -m pip install -q --no-deps "$TORCHAO_WHEEL" || echo "warning: $TORCHAO_WHEEL did not install"
fi
step preflight 20 "$PYTHON" - "$DEVICE" "$OUT/preflight.json" <<'PY'
import json, sys
import torch
device, path = sys.argv[1], sys.argv[2]
found = {"device": device, "torch": torch.__version__}
try:
    import torchao
    found["torchao"] = getattr(torchao, "__version__", "unknown")
except Exception as error:  # absent, or built for another torch
    found["torchao"] = f"absent ({type(error).__name__})"
ok = True
if device == "cuda":
    found["cuda"] = torch.cuda.is_available()
    if found["cuda"]:
        found["name"] = torch.cuda.get_device_name()
        found["capability"] = list(torch.cuda.get_device_capability())
    ok = bool(found["cuda"]) and tuple(found.get("capability", (0, 0))) >= (8, 9)
json.dump(found, open(path, "w"), indent=1)
print(found)
sys.exit(0 if ok else 1)
PY
if [ "$status" -ne 0 ]; then
  echo "preflight failed: no CUDA device with float8 GEMMs (compute capability >= 8.9)"
  exit 1
fi
step fp8_tests 45 "$PYTHON" -m pytest -q -p no:cacheprovider tests/transforms/test_to_fp8_cuda.py
step fp8_step 255 "$PYTHON" benchmarks/bench_fp8_step.py --device "$DEVICE" \
  --budget-s 240 --output "$OUT/fp8_step.json"
step fsdp_allgather "$fsdp_s" "$PYTHON" benchmarks/bench_fsdp_allgather.py --device "$DEVICE" \
  --output "$OUT/fsdp_allgather.json"
step tests 50 "$PYTHON" -m pytest -q -p no:cacheprovider tests/formats tests/tracking -k "$tests"
step formats 40 "$PYTHON" benchmarks/bench_formats.py --device "$DEVICE" --rounds "$rounds" \
  --log2-numel "$formats_numel" --output "$OUT/formats.json"
step tracking 60 "$PYTHON" benchmarks/bench_tracking.py --device "$DEVICE" --models "$models" \
  --rounds "$rounds" --no-variable-lengths --out "$OUT/tracking.json"
step fp8_scaling 35 "$PYTHON" benchmarks/bench_fp8_scaling.py --device "$DEVICE" \
  --rounds "$rounds" --steps-per-round 3 --output "$OUT/fp8_scaling.json"
step compile_lengths 35 "$PYTHON" benchmarks/bench_compile_lengths.py --device "$DEVICE" \
  --lengths "$lengths" --output "$OUT/compile_lengths.json"
step tracking_zoo 100 "$PYTHON" benchmarks/bench_tracking_zoo.py --device "$DEVICE" \
  --archs "$archs" --rounds "$rounds" --out "$OUT/tracking_zoo.json"
exit "$status"
