#!/usr/bin/env bash
# Before against after on one GPU in one run: the step benchmarks that a change must not slow, alternated between a
# baseline tree and this one so that drift in the machine hits both alike. Run from the repository root:
#   git archive <base commit> | tar -x -C .baseline && bash benchmarks/before_after.sh .baseline
# Each benchmark's JSON lands in $OUT/base/ and $OUT/new/ (default benchmarks/out), its log in $OUT/base.log and
# $OUT/new.log; each table prints as it comes. Names after the rounds pick benchmarks (default: all three).
set -o pipefail
base=${1:?usage: before_after.sh BASELINE_TREE [ROUNDS [NAME...]]}
rounds=${2:-1}
names=("${@:3}")
((${#names[@]})) || names=(b1_latency nanovllm_bench main_job)
PY=${PYTHON:-python3}
here=$PWD
export OUT=${OUT:-benchmarks/out} PYTHONUNBUFFERED=1
mkdir -p "$OUT/base" "$OUT/new"
out=$(cd "$OUT" && pwd)
bench() {  # bench TREE LABEL NAME ARGS...
    local tree=$1 label=$2 name=$3
    shift 3
    echo "=== $label $name: $*"
    (cd "$tree" && PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 240 "$PY" -m "$@" --out "$out/$label" 2>&1) \
        | tee -a "$out/$label.log" | grep -A30 -e "^## " -e "^| mode |"
}
for ((round = 0; round < rounds; round++)); do
    for name in "${names[@]}"; do
        case $name in
            b1_latency) args=(benchmarks.b1_latency --batches) ;;
            nanovllm_bench) args=(benchmarks.nanovllm_bench) ;;
            main_job) args=(benchmarks.main_job --repeats 2) ;;
        esac
        bench "$base" base "$name" "${args[@]}"
        bench "$here" new "$name" "${args[@]}"
    done
done
