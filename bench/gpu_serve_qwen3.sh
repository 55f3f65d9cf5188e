#!/usr/bin/env bash
# The issue-31 GPU workload: vLLM's published H100 figure for Qwen3-0.6B in bf16 (94.91 req/s,
# TPOT mean 5.45 ms; `vllm bench serve`, random dataset, 512 input and 128 output tokens, 500
# prompts, request rate inf, --gpu-memory-utilization 0.5 --max-model-len 2048), run with
# `pagedserve bench serve` on a random model of Qwen3-0.6B's shape. Per server configuration in
# CONFIGS ('|'-separated extra `pagedserve serve` options; default: none), one warm-up, then RUNS runs.
set -u
OUT=${OUT:-/tmp/gpu-out}
MODEL=${PAGEDSERVE_BENCH_MODELS:-/tmp/bench-models}/qwen3-0.6b
python3 - "$MODEL" <<'PY'
import sys
from pathlib import Path
from pagedserve.tools.demo_model import build_model_dir
if not (Path(sys.argv[1]) / "config.json").exists():
    build_model_dir(sys.argv[1], "qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                    head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                    tie_word_embeddings=True, rope_theta=1000000.0, seed=1234, dtype="bfloat16")
PY
[ -n "${BUILD_ONLY:-}" ] && exit 0
# BENCH_ARGS: extra `pagedserve bench serve` options for every run (e.g. --temperature 1.0: sampled, the API's default)
# shellcheck disable=SC2086
bench() { pagedserve bench serve --url http://127.0.0.1:8012 --input-len 512 512 --output-len 128 --no-progress \
  ${BENCH_ARGS:-} "$@"; }
IFS='|' read -r -a configs <<<"${CONFIGS:-}"
[ ${#configs[@]} -eq 0 ] && configs=("")
c=0
for extra in "${configs[@]}"; do
  c=$((c + 1))
  echo "=== config $c: pagedserve serve MODEL --dtype bfloat16 --gpu-memory-utilization 0.5 --max-model-len 2048 $extra"
  # shellcheck disable=SC2086
  pagedserve serve "$MODEL" --dtype bfloat16 --gpu-memory-utilization 0.5 --max-model-len 2048 --port 8012 $extra \
    >"$OUT/server06-$c.log" 2>&1 &
  pid=$!
  for i in $(seq 600); do curl -sf localhost:8012/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  bench --num-prompts 500 --output-json /tmp/warm.json | tail -n 1
  for r in $(seq "${RUNS:-3}"); do
    bench --num-prompts 500 --output-json "$OUT/serve06-$c-$r.json" | grep -E "req/s|TPOT|TTFT " | head -n 3
  done
  kill -INT $pid; wait $pid
done
