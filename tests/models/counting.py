"""A module wrapper that counts its calls: how tracking tests see that a detector did not run."""

from __future__ import annotations

import torch


class CountingModule(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *inputs):
        self.calls += 1
        return self.inner(*inputs)
