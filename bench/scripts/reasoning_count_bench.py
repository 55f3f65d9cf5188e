"""What counting ``reasoning_tokens`` costs a request when it finishes: the bisection of
frontend_proc/reasoning/token_count.py over one choice's output, in process.

    python bench/scripts/reasoning_count_bench.py [--lengths 1000 8000 32000] [--repeats 20]

The output is the thinking demo model's tokenizer (``</think>`` one token, as in Qwen3's) over
text from its own corpus: half thinking, then ``</think>``, then the answer. Each length's
median time of ``reasoning_token_count`` with the end tag's ids (the fast path) and without
(bisection) is printed beside one ``decode`` of the whole output, the cost the detokenizer
already paid once, piece by piece, while streaming.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.reasoning import REASONING_PARSERS
from pagedserve.frontend_proc.reasoning.token_count import reasoning_token_count
from pagedserve.tools.demo_model import _CORPUS, THINKING_CHAT_TEMPLATE, build_tokenizer


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 8000, 32000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(1024, THINKING_CHAT_TEMPLATE, think_tokens=True).save_pretrained(tmp)
        tokenizer = PromptTokenizer(Path(tmp))
    piece = tokenizer.tokenizer.encode(_CORPUS, add_special_tokens=False)
    corpus = piece * (max(args.lengths) // len(piece) + 1)
    end = tokenizer.tokenizer.convert_tokens_to_ids("</think>")
    qwen3 = REASONING_PARSERS["qwen3"]
    print(f"{'output tokens':>13} {'fast path (us)':>15} {'bisection (us)':>15} {'one decode (us)':>16}")
    for length in args.lengths:
        half = length // 2
        ids = corpus[:half] + [end] + corpus[half:length - 1]
        text = tokenizer.decode(ids)
        assert len(ids) == length
        assert reasoning_token_count(qwen3, text, ids, tokenizer) == half + 1
        assert reasoning_token_count(qwen3, text, ids, tokenizer, [end]) == half + 1
        fast = _median_us(lambda: reasoning_token_count(qwen3, text, ids, tokenizer, [end]), args.repeats)
        bisection = _median_us(lambda: reasoning_token_count(qwen3, text, ids, tokenizer), args.repeats)
        decode = _median_us(lambda: tokenizer.decode(ids), args.repeats)
        print(f"{length:>13} {fast:>15.0f} {bisection:>15.0f} {decode:>16.0f}")


if __name__ == "__main__":
    main()
