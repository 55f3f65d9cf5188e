#!/usr/bin/env bash
# The issue-31 GPU workload: vLLM's published H100 figure for Qwen3-0.6B in bf16 (94.91 req/s,
# TPOT mean 5.45 ms; `vllm bench serve`, random dataset, 512 input and 128 output tokens, 500
# prompts, request rate inf, --gpu-memory-utilization 0.5 --max-model-len 2048), run with
# `pagedserve bench serve` on a random model of Qwen3-0.6B's shape. One warm-up, then RUNS runs.
set -u
OUT=${OUT:-/tmp/gpu-out}
MODEL=${PAGEDSERVE_BENCH_MODELS:-/tmp/bench-models}/qwen3-0.6b
python3 - "$MODEL" <<'PY'
import sys
from pathlib import Path
try:
    from pagedserve.tools.demo_model import build_model_dir
except ImportError:
    from pagedserve.deploy.demo_model import build_model_dir
if not (Path(sys.argv[1]) / "config.json").exists():
    build_model_dir(sys.argv[1], "qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                    head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                    tie_word_embeddings=True, rope_theta=1000000.0, seed=1234, dtype="bfloat16")
PY
pagedserve serve "$MODEL" --dtype bfloat16 --gpu-memory-utilization 0.5 --max-model-len 2048 --port 8012 \
  >"$OUT/server06.log" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid' EXIT
for i in $(seq 600); do curl -sf localhost:8012/health >/dev/null && break; sleep 0.5; done
bench() { pagedserve bench serve --url http://127.0.0.1:8012 --input-len 512 512 --output-len 128 --no-progress "$@"; }
bench --num-prompts 64 --output-json /tmp/warm.json | tail -n 3
for r in $(seq "${RUNS:-3}"); do
  echo "--- run $r"
  bench --num-prompts 500 --output-json "$OUT/serve06-$r.json" | tail -n 8
done
grep -i "graphs\|kernels:" "$OUT/server06.log" | head -n 5
