"""Shared cases for the decode GEMV kernels' tests (tests/kernels/test_gemv_*.py): weights
with an all-zero channel and an outlier, the op shapes and row counts, a bare linear layer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

BF16_ULP = 2.0**-7
SHAPES = [(48, 64), (96, 256), (32, 384)]  # (out, in); 384 = 3 groups of 128

# Every op test runs these: float32 and bfloat16 x, 0..32 rows (the kernel's register blocks of
# 1-4 rows and their remainders, several blocks sharing a tile's next-tile prefetch, the row
# limit), each shape, with and without bias.
op_cases = [
    pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16]),
    pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32]),
    pytest.mark.parametrize("shape", SHAPES),
    pytest.mark.parametrize("with_bias", [False, True]),
]


def with_op_cases(test):  # type: ignore[no-untyped-def]
    for mark in reversed(op_cases):
        test = mark(test)
    return test


def group_for(shape: tuple[int, int]) -> int:
    """Groups of 128 on the (32, 384) shape, 32 elsewhere."""
    n, k = shape
    return 128 if k % 128 == 0 and n == 32 else 32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=gen(seed)) / math.sqrt(k)
    w[1] = 0.0  # an all-zero channel
    w[2, 5] = 30 * w.abs().max()  # an outlier in one group
    return w


class BareLinear(nn.Module):
    """What a linear method needs of a layer: sizes, a weight, an optional bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.output_size, self.input_size = weight.shape
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = bias
