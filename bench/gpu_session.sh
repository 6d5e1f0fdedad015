#!/usr/bin/env bash
# One device call for a session's GPU checks, each step with its own time limit so that the call ends
# inside the device tool's 10 minutes and leaves what it finished under $OUT:
#   bash bench/gpu_session.sh [STEP...]     (steps: gluon slices numerics gpu-tests host ab fuzz tests+fuzz;
#                                            default: all but tests+fuzz)
# tests+fuzz runs the fuzzer in the background on the same GPU while gpu-tests runs, for the call's
# whole time (the fuzz's small shapes fit beside the tests; the tests' time is then a loaded one).
# TRL and its `datasets` travel as wheels in .whl (the device README's way; carry ".whl"), so that the
# TRL GPU tests run rather than skip. The package is installed editable without its dependencies
# (the image's torch and triton are used as they are). The steps host and ab compare with a baseline
# checkout in .base (carry ".base"), built into a wheel and installed apart (PYTHONPATH=/tmp/base).
set -uo pipefail
out="${OUT:-/tmp/gpu-session}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$out/install.log" 2>&1 \
  || { tail -5 "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -d .base ]; then
  (cd .base && python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/basewhl . > /dev/null 2>&1) \
    && python3 -m pip install -q --no-deps --no-index --target /tmp/base /tmp/basewhl/*.whl > /dev/null 2>&1 \
    || echo "the baseline in .base did not build"
fi
fuzz() {   # the fuzzer for $1 seconds of the call (25 of them to finish and print)
  minutes=$(python3 -c "print(round(($1 - 25) / 60, 2))")
  timeout "$1" python3 -m losscodegen fuzz --device cuda --minutes "$minutes" --seed "${FUZZ_SEED:-4545}" \
    > "$out/fuzz.txt" 2>&1
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gluon slices numerics gpu-tests host ab fuzz)
summary=()
for step in "${steps[@]}"; do
  t0=$SECONDS
  case "$step" in
    gluon)      # issue 47's one-read CE prototype beside the default call and the copy rate
      timeout 200 python3 bench/gluon_row.py --out "$out" > "$out/gluon.txt" 2>&1; rc=$? ;;
    slices)     # issue 47's row-slices kernel of the compiler: its GPU tests, then beside the default call
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_slices.py > "$out/slices-tests.txt" 2>&1
      timeout 200 python3 bench/slices.py --out "$out" --quick --skip-parity > "$out/slices.txt" 2>&1; rc=$?
      tail -13 "$out/slices.txt" ;;
    numerics)   # issue 45's regimes on the GPU's compiled kernels (assert_parity runs on cuda)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_numerics.py \
        -k "every_built_in or focal or parameter or all_rows" > "$out/numerics.txt" 2>&1; rc=$? ;;
    gpu-tests)  # every gpu-marked test of the suite, both backends, TRL's included
      timeout 480 python3 -m pytest -q -p no:cacheprovider -m gpu tests --all-backends --durations=15 \
        > "$out/gpu-tests.txt" 2>&1; rc=$? ;;
    host)       # the default CE call's host time to enqueue, the baseline's and this tree's, twice each
      for i in 1 2; do
        PYTHONPATH=/tmp/base${PYTHONPATH:+:$PYTHONPATH} timeout 90 python3 bench/host_profile.py base >> "$out/host.txt" 2>&1
        timeout 90 python3 bench/host_profile.py new >> "$out/host.txt" 2>&1
      done; rc=$?
      grep "==" "$out/host.txt" ;;
    ab)         # the benchmark heads before (the baseline) and after, alternating, in one call
      for i in 1 2; do
        PYTHONPATH=/tmp/base${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 bench/ab.py base CE GRPO+entropy+clip >> "$out/ab.jsonl" 2>> "$out/ab.err"
        timeout 120 python3 bench/ab.py new CE GRPO+entropy+clip >> "$out/ab.jsonl" 2>> "$out/ab.err"
      done; rc=$?
      cat "$out/ab.jsonl" ;;
    fuzz)       # the differential fuzzer on the GPU for what is left of the call
      left=$(( 570 - SECONDS ))
      [ "$left" -lt 30 ] && { summary+=("fuzz: no time left"); continue; }
      fuzz "$left"; rc=$? ;;
    tests+fuzz) # gpu-tests with the fuzzer beside it on the same GPU, for what is left of the call
      left=$(( 570 - SECONDS ))
      fuzz "$left" & fuzz_pid=$!
      timeout 480 python3 -m pytest -q -p no:cacheprovider -m gpu tests --all-backends --durations=15 \
        > "$out/gpu-tests.txt" 2>&1; rc=$?
      summary+=("gpu-tests: rc=$rc in $(( SECONDS - t0 )) s (the fuzz beside it): $(tail -1 "$out/gpu-tests.txt" | cut -c1-160)")
      echo "${summary[-1]}"
      wait "$fuzz_pid"; rc=$?; step=fuzz ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  summary+=("$step: rc=$rc in $(( SECONDS - t0 )) s: $(tail -1 "$out/${step%%-*}"*.txt 2>/dev/null | cut -c1-160)")
  echo "${summary[-1]}"
done
echo "---- gluon (last lines)"; tail -12 "$out/gluon.txt" 2>/dev/null
printf '%s\n' "${summary[@]}"
