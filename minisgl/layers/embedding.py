import torch

from minisgl.distributed import all_gather, all_reduce, get_tp_info
from minisgl.engine.context import current_forward
from minisgl.kernel import indexing, pack_weight, rmsnorm_linear
from minisgl.utils import div_ceil

from .base import BaseOP
from .norm import RMSNorm


class VocabParallelEmbedding(BaseOP):
    """Each rank keeps a slice of the vocabulary, fills zeros for tokens it does not hold, and the
    slices are summed across ranks (every token is non-zero on exactly one rank)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        tp = get_tp_info()
        self._tp_size = tp.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_tp = div_ceil(num_embeddings, tp.size)
        start = self.num_embeddings_tp * tp.rank
        finish = min(start + self.num_embeddings_tp, num_embeddings)
        self.vocab_range = (start, finish - start)
        self.weight = torch.empty(self.num_embeddings_tp, embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._tp_size == 1:
            return indexing(self.weight, x)
        return all_reduce(indexing(self.weight, x, self.vocab_range))


class ParallelLMHead(VocabParallelEmbedding):
    """The output layer. Logits are computed only for the rows sampling needs: each request's last
    position in a prefill (the LM head is one of the largest matmuls), every row in a decode."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tied_embedding: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim)
        # underscore: the tied weight belongs to the embedding and is loaded once, there
        self._tied_embedding = tied_embedding
        if tied_embedding is not None:
            del self.weight
        self._packed: torch.Tensor | None = None

    def _weight(self) -> torch.Tensor:
        return self._tied_embedding.weight if self._tied_embedding is not None else self.weight

    def pack_weights(self) -> None:
        self._packed = pack_weight(self._weight())

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> torch.Tensor:
        """Logits of norm(x + residual): the model's final norm runs here, in the matmul's kernel
        for a tiny decode batch on a GPU."""
        batch = current_forward()
        if not batch.is_decode:
            # x may be partial sums [splits, rows, N] (LinearRowParallel); a prefill's rows for
            # prompt logprobs come after each request's last one
            rows = batch.inputs.last_indices
            if batch.inputs.prompt_rows.shape[0]:
                rows = torch.cat([rows, batch.inputs.prompt_rows])
            x, residual = x[..., rows, :], residual[rows]
        return self.logits(x, residual, norm)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """Logits of norm(x + residual) for every row."""
        logits, _ = rmsnorm_linear(
            x, residual, norm.weight, norm.eps, self._weight(), packed=self._packed
        )
        if self._tp_size == 1:
            return logits
        # all_gather stacks ranks along dim 0: [tp * rows, V/tp] -> [rows, tp * V/tp]
        gathered = all_gather(logits).view(self._tp_size, *logits.shape)
        gathered = gathered.permute(1, 0, 2).reshape(logits.shape[0], -1)
        return gathered[:, : self.num_embeddings]
