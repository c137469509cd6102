"""What the engine reads of mlx-lm's `GenerationBatch` beyond its public fields, in one place.

A paused row leaves the batch with its exact state, and two parts of that state have no public
reader in mlx-lm 0.32.2: the token the batch has already sampled for the row's next step
(`GenerationBatch` samples one step ahead: `_next_tokens`, with its logprobs in `_next_logprobs`),
and how many tokens the row has produced since it joined (`_num_tokens`, counted against the public
`max_tokens`). Without them a resumed row would resample a token it already drew (a different one
under sampling) or overrun its max_tokens. Everything else (uids, tokens, extract_cache, filter,
extend) is public and read where it is used. An mlx-lm upgrade that renames these fails
tests/test_pressure_edge_cases.py's token-identity tests.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import GenerationBatch


def lookahead(batch: GenerationBatch, index: int) -> tuple[int, mx.array]:
    """The token already sampled as row `index`'s next output, and its logprobs."""
    return batch._next_tokens[index].item(), batch._next_logprobs[index]


def tokens_left(batch: GenerationBatch, index: int) -> int:
    """Tokens row `index` may still produce in this batch (its max_tokens less those it produced)."""
    return batch.max_tokens[index] - batch._num_tokens[index]
