#!/usr/bin/env bash
# The GPU run: the gpu tests, then every benchmark with its defaults. Run from the repository root:
#   bash benchmarks/run_gpu.sh              # every step, in order
#   bash benchmarks/run_gpu.sh peers bench_linear   # only the named steps (one device command holds ~10 minutes)
# Each step writes its JSON to $OUT (default benchmarks/out) and its log to $OUT/<name>.log. A failing or
# timed-out step is recorded in $OUT/failures.txt and the run goes on; all tables are printed at the end.
# Every step gets min(its cap, the time left of BUDGET_S), so the whole run ends before the device's 10-minute limit.
set -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OUT=${OUT:-benchmarks/out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: > "$OUT/failures.txt"
deadline=$((SECONDS + ${BUDGET_S:-560}))
names=()

wanted=" $* "
step() {  # step NAME CAP_SECONDS COMMAND...
    local name=$1 cap=$2 left=$((deadline - SECONDS))
    shift 2
    [[ $wanted == "  " || $wanted == *" $name "* ]] || return 0
    names+=("$name")
    if ((left < 30)); then
        echo "$name: skipped, no time left" | tee -a "$OUT/failures.txt"
        return
    fi
    echo "=== $name (limit $((cap < left ? cap : left)) s): $*"
    timeout "$((cap < left ? cap : left))" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    if ((rc != 0)); then
        echo "$name: exit status $rc$( ((rc == 124)) && echo ' (timed out)')" | tee -a "$OUT/failures.txt"
    fi
}

step pytest_gpu 180 "$PY" -m benchmarks.pytest_gpu
step seed_table 150 "$PY" -m benchmarks.seed_table
step sampled_decode 150 "$PY" -m benchmarks.sampled_decode
step b1_latency 180 "$PY" -m benchmarks.b1_latency
step b1_latency_no_pdl 120 "$PY" -m benchmarks.b1_latency --no-pdl --batches 64
step b1_latency_unfused_silu 120 "$PY" -m benchmarks.b1_latency --unfused-silu --batches 64
step nanovllm_bench 120 "$PY" -m benchmarks.nanovllm_bench
step nanovllm_bench_fp8 120 "$PY" -m benchmarks.nanovllm_bench --kv-cache-dtype fp8
step profile_decode 90 "$PY" -m benchmarks.profile_decode --batches 1 64 256
step nanovllm_bench_sync 120 "$PY" -m benchmarks.nanovllm_bench --sync
step nanovllm_bench_mixed 120 "$PY" -m benchmarks.nanovllm_bench --mixed
# The cb peer's own limit (30 to 300 s) leaves about 2 minutes for loading, warm-up and the other two peer parts.
cb_limit=$((deadline - SECONDS - 120))
cb_limit=$((cb_limit > 300 ? 300 : cb_limit < 30 ? 30 : cb_limit))
step peers 450 "$PY" -m benchmarks.peers --num-seqs 256 --time-limit "$cb_limit"
step prefix_cache 240 "$PY" -m benchmarks.prefix_cache
step bench_attention 60 "$PY" -m benchmarks.bench_attention
step sweep_decode_attention 200 "$PY" -m benchmarks.sweep_decode_attention
step sweep_decode_attention_fp8 120 "$PY" -m benchmarks.sweep_decode_attention --kv-cache-dtype fp8 --batches 256
step sweep_decode_splits 90 "$PY" -m benchmarks.sweep_decode_splits
step sweep_decode_splits_fp8 90 "$PY" -m benchmarks.sweep_decode_splits --kv-cache-dtype fp8
step bench_cascade_attention 60 "$PY" -m benchmarks.bench_cascade_attention
step bench_prefill_attention 90 "$PY" -m benchmarks.bench_prefill_attention
step bench_prefill_attention_fp8 90 "$PY" -m benchmarks.bench_prefill_attention --kv-cache-dtype fp8
# 36 launch configurations on two head shapes: about 72 compiles.
step sweep_prefill_attention 420 "$PY" -m benchmarks.bench_prefill_attention --sweep
step bench_linear 90 "$PY" -m benchmarks.bench_linear
step main_job_cold 150 "$PY" -m benchmarks.main_job --fresh-caches
step main_job 120 "$PY" -m benchmarks.main_job
step profile_prefill_host 90 "$PY" -m benchmarks.profile_prefill_host
step startup 90 "$PY" -m benchmarks.startup
step bench_fused 60 "$PY" -m benchmarks.bench_fused
step bench_gemv_chain 60 "$PY" -m benchmarks.bench_gemv_chain
step bench_sampling 150 "$PY" -m benchmarks.bench_sampling
# Whole jobs, one workload per step; each workload's own --timeout ends it 20 s before its step's cap, so that a slow
# one is reported as failed in the JSON and the table instead of killed with them.
step real_jobs_chat_mix 240 "$PY" -m benchmarks.real_jobs chat_mix --timeout 220
step real_jobs_classify 120 "$PY" -m benchmarks.real_jobs classify --timeout 100
step real_jobs_many_rows 200 "$PY" -m benchmarks.real_jobs many_rows --timeout 180
step real_jobs_many_rows_shared 200 "$PY" -m benchmarks.real_jobs many_rows_shared --timeout 180
step real_jobs_scoring 120 "$PY" -m benchmarks.real_jobs scoring --timeout 100
step real_jobs_cold_start 180 "$PY" -m benchmarks.real_jobs cold_start --timeout 160
# Qwen3-30B-A3B's shape (a mixture of experts, 57 GiB of bf16 weights: one 80 GB GPU); each engine loads it anew.
step b1_latency_qwen3_30b_a3b 400 "$PY" -m benchmarks.b1_latency --model qwen3_30b_a3b --repeats 1 --batches 8 64 256
step nanovllm_bench_qwen3_30b_a3b 400 "$PY" -m benchmarks.nanovllm_bench --model qwen3_30b_a3b
# fp8 weights (model.quantization=fp8) against bf16, on the Qwen3-0.6B and Llama-3.1-8B shapes; fp8 vs bf16 accuracy.
step b1_latency_fp8_weights 150 "$PY" -m benchmarks.b1_latency --quantization fp8 --batches 8 64
step b1_latency_llama3_1_8b 240 "$PY" -m benchmarks.b1_latency --model llama3_1_8b --batches 8 64
step b1_latency_llama3_1_8b_fp8_weights 240 "$PY" -m benchmarks.b1_latency --model llama3_1_8b --quantization fp8 \
    --batches 8 64
step nanovllm_bench_fp8_weights 120 "$PY" -m benchmarks.nanovllm_bench --quantization fp8
step nanovllm_bench_llama3_1_8b 300 "$PY" -m benchmarks.nanovllm_bench --model llama3_1_8b
step nanovllm_bench_llama3_1_8b_fp8_weights 300 "$PY" -m benchmarks.nanovllm_bench --model llama3_1_8b \
    --quantization fp8
step bench_linear_llama3_1_8b_fp8_weights 150 "$PY" -m benchmarks.bench_linear --model llama3_1_8b --dtype fp8
step bench_gemv_chain_llama3_1_8b_fp8_weights 90 "$PY" -m benchmarks.bench_gemv_chain --model llama3_1_8b --dtype fp8
step profile_decode_llama3_1_8b_fp8_weights 150 "$PY" -m benchmarks.profile_decode --model llama3_1_8b \
    --quantization fp8 --batches 1 8
step fp8_accuracy 240 "$PY" -m benchmarks.fp8_accuracy
if (( $("$PY" -c "import torch; print(torch.cuda.device_count())") >= 2 )); then  # tensor parallelism
    step bench_all_reduce 90 "$PY" -m benchmarks.bench_all_reduce
    step b1_latency_llama3_1_8b_tp2 150 "$PY" -m benchmarks.b1_latency --model llama3_1_8b --modes graph \
        --batches 64 --tensor-parallel-size 2
    step b1_latency_llama3_1_8b_tp2_nccl 150 "$PY" -m benchmarks.b1_latency --model llama3_1_8b --modes graph \
        --batches 64 --tensor-parallel-size 2 --no-custom-all-reduce
fi

echo
echo "# Results ($OUT)"
for name in "${names[@]}"; do
    log="$OUT/$name.log"
    [[ -f $log ]] || continue
    echo
    if [[ $name == pytest_gpu ]]; then
        echo "## pytest -m gpu"
        grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|error)" "$log" | tail -n 20
    elif grep -q "^## " "$log"; then
        # Each benchmark prints its table last, under a "## " heading.
        awk '/^## /{buf = ""; keep = 1} keep {buf = buf $0 "\n"} END {printf "%s", buf}' "$log"
    else
        echo "## $name: no markdown table; the end of its log:"
        tail -n 12 "$log"
    fi
done
echo
if [[ -s $OUT/failures.txt ]]; then
    echo "## Failures"
    cat "$OUT/failures.txt"
    exit 1
fi
echo "All steps succeeded."
