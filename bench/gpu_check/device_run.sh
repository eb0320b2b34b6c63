#!/usr/bin/env bash
# The GPU check as one prepared command for a borrowed GPU machine (one command may run 10 minutes; the
# session has about 15 in all): five runs of `python -m bench.gpu_check`, in order, each under `timeout`
# with its own cap, all of them within GPU_CHECK_TOTAL_S seconds (default 480: a run whose cap no longer
# fits is cut to what is left, and skipped under MIN_RUN_S). A run that fails or times out does not stop
# the next. The runs are listed once, in `each_run` below. GPU_CHECK_RUNS names the runs to make (default
# all: "a b c d e"); the five caps add up to more than 480 s, so the last ones are cut or skipped unless the
# first ones end early: `GPU_CHECK_RUNS="a b e"` measures the SDAR-4B step with and without the overlap
# schedule first.
#
#   bench/gpu_check/device_run.sh [DIR]        DIR defaults to $OUT, else gpu-out; python is $PYTHON, else PATH's
#
# DIR/<run>/ holds the run's stdout.log, stderr.log, each part's JSON (--out) and report.json once it
# finished; DIR/exit_codes.txt a line per run, `RUN EXIT_CODE SECONDS CAP_S` (124: timed out, `skipped`:
# no time left). At the end `python -m bench.gpu_check.collect` gathers them into DIR/summary.json, and
# the run folders are packed into DIR/runs.tar.gz (the device machine hands back at most 8 files; set
# GPU_CHECK_KEEP_FOLDERS=1 to keep them unpacked). Exit status: 0 when every run exited 0, else 1.
set -u

dir=${1:-${OUT:-gpu-out}}
py=${PYTHON:-python}
total=${GPU_CHECK_TOTAL_S:-480}
MIN_RUN_S=20

# each_run FUNCTION: FUNCTION NAME CAP_S ARGS... for every run, in order (the one list of the runs)
each_run() {
    "$1" a 90 --only machine flash
    "$1" b 200 --only sdar_4b --attention triton
    "$1" c 200 --only throughput --attention triton --throughput-seconds 120
    "$1" d 60 --only seeded_sampling
    "$1" e 150 --only sdar_4b --attention triton --set overlap_schedule=true
}
known=" "
know_run() { known+="$1 "; }
each_run know_run
selected=" ${GPU_CHECK_RUNS:-$known} "
for name in $selected; do
    [[ $known == *" $name "* ]] || { echo "GPU_CHECK_RUNS: no run named '$name' (the runs:$known)" >&2; exit 2; }
done
KILL_AFTER_S=5  # SIGKILL this long after timeout's SIGTERM, counted in the budget

mkdir -p "$dir" && dir=$(cd "$dir" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2  # the repository root: `-m bench.gpu_check` resolves there
: >"$dir/exit_codes.txt"
status=0

# run_part RUN CAP_S ARGS...: `python -m bench.gpu_check ARGS... --out DIR/RUN` under `timeout`
run_part() {
    local name=$1 cap=$2
    shift 2
    [[ $selected == *" $name "* ]] || return 0
    local left=$((total - SECONDS - KILL_AFTER_S)) start=$SECONDS code
    ((cap > left)) && cap=$left
    mkdir -p "$dir/$name"
    if ((cap < MIN_RUN_S)); then
        echo "$name skipped 0 $cap" >>"$dir/exit_codes.txt"
        echo "gpu_check run $name ($*): skipped, ${left} s left of ${total} s" >&2
        status=1
        return
    fi
    echo "gpu_check run $name ($*): cap ${cap} s" >&2
    timeout -k "$KILL_AFTER_S" "$cap" "$py" -m bench.gpu_check "$@" --out "$dir/$name" \
        >"$dir/$name/stdout.log" 2>"$dir/$name/stderr.log"
    code=$?
    echo "$name $code $((SECONDS - start)) $cap" >>"$dir/exit_codes.txt"
    echo "gpu_check run $name: exit $code after $((SECONDS - start)) s" >&2
    ((code == 0)) || status=1
}

each_run run_part

timeout 60 "$py" -m bench.gpu_check.collect "$dir" || status=1
if [[ ${GPU_CHECK_KEEP_FOLDERS:-0} != 1 ]]; then
    read -ra runs <<<"$selected"
    tar -czf "$dir/runs.tar.gz" -C "$dir" "${runs[@]}" && (cd "$dir" && rm -rf "${runs[@]}")
fi
exit "$status"
