#!/usr/bin/env bash
# The GPU checks, as one prepared run on a machine with CUDA (the README's "On a GPU" figures
# come from it). Each part is bounded by its own timeout and writes its log under OUTDIR, so a
# part that fails or runs long leaves the others' results.
#
#   bash scripts/device_checks.sh OUTDIR [env] [cuda-tests] [suite] [bench-inprocess] [profile]
#                                        [bench-scan] [bench-long]  (default: all, in this order)
set -u
out=${1:?usage: device_checks.sh OUTDIR [part ...]}
shift
parts=${*:-env cuda-tests suite bench-inprocess profile bench-scan bench-long}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

part() {  # part NAME SECONDS COMMAND...: run COMMAND bounded, its output to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local code=$?
    echo "== $name: exit $code in $((SECONDS - started)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

for p in $parts; do
    case $p in
    env)
        # (its log stays out of OUTDIR, which the device tool brings back at most 8 files of)
        $python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 \
            || { echo "install failed:"; tail -n 20 /tmp/install.log; } | tee -a "$out/summary.txt"
        part env 60 bash -c "nvidia-smi -L; nproc; $python -c 'import torch, sys; \
print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
$python -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|accelerate|lightning) '" ;;
    cuda-tests)
        part cuda-tests 150 $python -m pytest -q -p no:cacheprovider -rs \
            tests/run/test_cuda.py tests/commands/test_run_cuda.py \
            "tests/integrations/test_transformers.py::test_trainer_fp16_on_cuda_skips_a_bad_step_and_the_scaler_trains_on" ;;
    bench-inprocess)
        part bench-inprocess 130 $python scripts/bench_inprocess.py --device cuda --rounds 1 \
            --no-rerun-variant --steps 1000 10000 ;;
    profile)
        # where a clean step's time goes under `run` on the GPU: each hook, and the wait for
        # the device at the step's one read
        part profile 70 $python scripts/profile_run_step.py --device cuda --steps 3000 \
            --rounds 2 ;;
    bench-scan)
        # "keep-going" is scan --keep-going in the default read, deferred with the fused SGD
        # on CUDA (its read mode is in the JSON): against "nanaudit", keep-going's price.
        part bench-scan 100 $python scripts/bench.py --device cuda --rounds 5 --keep-going \
            --json "$out/bench-scan.json" ;;
    bench-long)
        part bench-long 150 $python scripts/bench_long.py --steps 20000 --rounds 3 \
            --variants plain,run,run-kg ;;
    suite)
        # -v: each test's outcome is logged as it ends, so a suite cut by its bound still
        # names the failures so far
        part suite 210 $python -m pytest -v -p no:cacheprovider -n 14 --dist worksteal \
            -rfE --durations=10 ;;
    *) echo "unknown part: $p" >&2; exit 2 ;;
    esac
done
