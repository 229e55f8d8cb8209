import torch


class KVPool:
    """The pre-allocated paged KV pool: K and V each [layers, pages, page_size, kv_heads, head_dim].

    A token's location is `page * page_size + offset`; one extra page at the end is the dummy page
    that padded rows (CUDA-graph padding) write into, so real pages are never touched by padding.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (2, num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        # zeroed once: kernels may load (masked) rows nobody wrote, which must not hold NaN
        self._buffer = torch.zeros(shape, dtype=dtype, device=device)
        self._k = self._buffer[0].view(num_layers, -1, num_kv_heads, head_dim)
        self._v = self._buffer[1].view(num_layers, -1, num_kv_heads, head_dim)

    @property
    def dummy_loc(self) -> int:
        return self.num_pages * self.page_size

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """[locations, kv_heads, head_dim]"""
        return self._k[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
