"""The paged KV cache tensor, block-major: one page is one contiguous slab of every layer's K/V."""

from __future__ import annotations

import torch

from pdserve.engine.malloc import huge_pages
from pdserve.kv.layout import KVLayout


class KVCache:
    """Owns the cache tensor [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim].

    Adjacent page ids are adjacent in memory, so a run of pages moves as one slice.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensor = torch.empty((num_blocks, *layout.block_shape), dtype=layout.torch_dtype, device=device)
        if self.tensor.device.type == "cpu":
            huge_pages(self.tensor.data_ptr(), self.tensor.numel() * self.tensor.element_size())
        self.tensor.zero_()

    @classmethod
    def blocks_for_bytes(cls, layout: KVLayout, nbytes: int) -> int:
        return nbytes // layout.block_nbytes

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the pages' slabs: [len(block_ids), *block_shape]."""
        return self.tensor[torch.tensor(block_ids, dtype=torch.long)].clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"KV blocks have shape {tuple(data.shape)}, this cache expects {expected}")
        if data.dtype != self.tensor.dtype:
            raise ValueError(f"KV blocks have dtype {data.dtype}, this cache holds {self.tensor.dtype}")
        self.tensor[torch.tensor(block_ids, dtype=torch.long)] = data.to(self.tensor.device)
