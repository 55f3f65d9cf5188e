"""A kernel's results at several torch thread counts, the count restored after."""

from __future__ import annotations

from typing import Callable

import torch


def results_at_thread_counts(run: Callable[[], torch.Tensor], counts=(1, 2, 3)) -> list[torch.Tensor]:
    threads, outs = torch.get_num_threads(), []
    try:
        for n in counts:
            torch.set_num_threads(n)
            outs.append(run())
    finally:
        torch.set_num_threads(threads)
    return outs
