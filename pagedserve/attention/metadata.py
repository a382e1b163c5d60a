"""Per-step attention metadata: built once per step by the model runner, read by every layer.

Flat batch layout (no padding). A step packs the new tokens of every scheduled request
back to back; request i owns rows query_start_loc[i] : query_start_loc[i+1]:

    tokens:  | req0 (decode: 1) | req1 (decode: 1) | req2 (prefill chunk: 5 ) | ...
    q_start: 0                  1                  2                         7

For request i, its new tokens sit at absolute positions
    seq_lens[i] - query_lens[i] .. seq_lens[i] - 1
and attend to every cached token of the request (positions 0 .. seq_lens[i]-1),
causally among themselves.

KV cache of one layer: a tensor of shape (2, num_blocks, block_size, num_kv_heads, head_dim);
index 0 is K, index 1 is V. Token at position p of a request lives in block
block_tables[i][p // block_size], offset p % block_size; its flat slot is
block_id * block_size + offset (slot_mapping gives that slot for each new token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Backend-independent description of one step's batch."""

    num_tokens: int
    num_seqs: int
    block_size: int
    # (num_tokens,) int64: flat KV slot where each new token's K/V is written.
    slot_mapping: torch.Tensor
    # (num_seqs + 1,) int64: prefix sum of query lengths.
    query_start_loc: torch.Tensor
    # (num_seqs,) int64: context length of each request once this step's tokens are in.
    seq_lens: torch.Tensor
    # (num_seqs, max_num_blocks) int64: block ids, padded with 0 past each request's blocks.
    block_tables: torch.Tensor
    # Host copies, so backends can plan without a device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
