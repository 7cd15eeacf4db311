#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a session that is lent one (the
# workplace's `device` tool), sized so that its steps' limits (540 s in all) fit one call
# (a rerun may not fit in 15 minutes of device time):
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=570)
#
# There, python3 already holds a CUDA build of PyTorch (and transformers, pytest); nothing can
# be fetched, so unitscale runs from src/ on PYTHONPATH. In order, each step under its own
# time limit, a failing step not stopping the next:
#   1. the CUDA cases of tests/formats and tests/tracking (`-k cuda`; CI runs the rest);
#   2. bench_formats.py --device cuda (with the users' path: torch.compile(fmt.quantise) for
#      several formats in one process, where Inductor generates the kernels);
#   3. bench_tracking.py --device cuda (bert4, bert2, tiny, gpt2; a step holds and reads its
#      scales graph; no fresh-process or CPU statistics parts, which are CPU figures);
#   4. bench_fp8_scaling.py --device cuda: step time of simulate_fp8's scaling="tensorwise"
#      and "delayed" against "none" (the CUDA line of what per-tensor scales cost);
#   5. bench_compile_lengths.py --device cuda (graphs of compile(unit_scale(gpt2)) vs
#      torch.compile over changing lengths);
#   6. bench_tracking_zoo.py --device cuda over six of its architectures (llama, gpt2, gptj,
#      bert, t5, mixtral: the CPU run's worst families among them), 5 rounds;
#   7. bench_fp8_step.py --device cuda: real FP8 step time and peak memory of a ~125M decoder
#      at sequence 2048, bf16 vs torchao tensorwise vs unit-scaled to_fp8, all compiled.
# Step 7 adds 150 s to the 540 above: in one call of at most 600 s it may be cut short, so
# run it alone in a second call where the first leaves time (STEPS=fp8_step runs only it):
#
#   run(command="STEPS=fp8_step bash benchmarks/device_check.sh", timeout_s=200)
# The benchmarks append their CUDA runs to copies of the committed histories in $OUT. Back on
# the development machine: copy $OUT/formats.json, $OUT/tracking.json,
# $OUT/fp8_scaling.json, $OUT/compile_lengths.json, $OUT/tracking_zoo.json and $OUT/fp8_step.json over
# benchmarks/results/, run `python benchmarks/readme_tables.py` (CUDA runs get rows of their
# own; the CPU rows keep coming from the newest CPU runs) and commit.
#
# DEVICE=cpu runs the same steps on the CPU (quick, for checking this script): the copies are
# made and appended to as on a GPU, with fewer rounds and one model.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
echo "results in $OUT"

if [ "$DEVICE" = cuda ]; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
  models=bert4,bert2,tiny,gpt2 rounds=5 formats_numel=24 tests="cuda"
  lengths=16,32,24,64,16,48 archs=llama,gpt2,gptj,bert,t5,mixtral
else
  models=tiny rounds=2 formats_numel=16 tests="cpu and nearest and not stochastic"
  lengths=16,32,16 archs=llama,bert
fi
cp benchmarks/results/formats.json benchmarks/results/tracking.json \
  benchmarks/results/fp8_scaling.json "$OUT"/
cp benchmarks/results/compile_lengths.json benchmarks/results/tracking_zoo.json \
  benchmarks/results/fp8_step.json "$OUT"/ 2>/dev/null || true
STEPS=${STEPS:-tests,formats,tracking,fp8_scaling,compile_lengths,tracking_zoo,fp8_step}

status=0
step() {  # step NAME SECONDS COMMAND...: one step's output to $OUT/NAME.log, its status kept
  local name=$1 seconds=$2
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  echo "=== $name (at most $seconds s) ==="
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc ==="
  [ "$rc" -eq 0 ] || status=1
}

step tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/formats tests/tracking -k "$tests"
step formats 100 "$PYTHON" benchmarks/bench_formats.py --device "$DEVICE" --rounds "$rounds" \
  --log2-numel "$formats_numel" --output "$OUT/formats.json"
step tracking 120 "$PYTHON" benchmarks/bench_tracking.py --device "$DEVICE" --models "$models" \
  --rounds "$rounds" --no-variable-lengths --out "$OUT/tracking.json"
step fp8_scaling 70 "$PYTHON" benchmarks/bench_fp8_scaling.py --device "$DEVICE" \
  --rounds "$rounds" --steps-per-round 3 --output "$OUT/fp8_scaling.json"
step compile_lengths 70 "$PYTHON" benchmarks/bench_compile_lengths.py --device "$DEVICE" \
  --lengths "$lengths" --output "$OUT/compile_lengths.json"
step tracking_zoo 60 "$PYTHON" benchmarks/bench_tracking_zoo.py --device "$DEVICE" \
  --archs "$archs" --rounds "$rounds" --out "$OUT/tracking_zoo.json"
step fp8_step 150 "$PYTHON" benchmarks/bench_fp8_step.py --device "$DEVICE" \
  --output "$OUT/fp8_step.json"
exit "$status"
