"""Engine = model + KV pool + attention backend + sampler (+ CUDA graphs).

It computes a batch and returns sampled tokens; it never changes a request. It allocates the two
device tables a batch reads, the page table and the token table, but their entries are decided
by the scheduler (its KV cache manager and token table) and written with each batch, except the
page table's dummy row set up here. The one thing a step writes back is each sampled token, into
the token-table entry the batch names: that is how the next step reads it without the host. The
same entry of the table's pinned host copy is where the host reads it.
"""

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from minisgl.attention import create_attention_backend
from minisgl.core import Batch, get_global_ctx, load_inputs
from minisgl.distributed import set_tp_info
from minisgl.kernel import sample_tokens
from minisgl.kvcache import KVPool
from minisgl.models import CausalLM, ModelConfig, load_model
from minisgl.utils import cached_load_hf_config, init_logger, resolve_device, resolve_dtype

from .config import EngineConfig
from .graph import GraphRunner
from .sampler import SampleOutput, Sampler, SamplingArgs

logger = init_logger(__name__)


@dataclass
class ForwardOutput:
    """A launched step's sampled tokens, on the host once `wait()` returns them: from copies made
    after the step, or (when the tokens are the step's own, the common case) from the host token
    table, at the entries the step's sampling kernel wrote."""

    done: torch.cuda.Event | None
    copies: SampleOutput | None = None
    host_entries: np.ndarray | None = None  # into the flattened host token table
    host_table: np.ndarray | None = None

    def wait(self) -> SampleOutput:
        if self.done is not None:
            self.done.synchronize()
        if self.copies is not None:
            return self.copies
        assert self.host_table is not None and self.host_entries is not None
        return SampleOutput(torch.from_numpy(self.host_table[self.host_entries]))


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and config.tp_size > 1:
            self.device = torch.device("cuda", config.tp_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        set_tp_info(config.tp_rank, config.tp_size)
        if config.tp_size > 1:
            self._init_distributed(config)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // config.tp_size))
        torch.manual_seed(0)

        self.model_config = ModelConfig.from_hf(cached_load_hf_config(config.model_path))
        mc = self.model_config
        free_before = _free_memory(self.device)
        self.model = load_model(
            config.model_path, mc, self.device, self.dtype, config.dummy_weights
        )

        self.num_pages = self._num_pages(free_before)
        self.page_size = config.page_size
        num_kv_heads = self.model.model.layers[0].self_attn.attn.num_kv_heads
        self.pool = KVPool(
            mc.num_layers,
            self.num_pages,
            self.page_size,
            num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        # the longest sequence: what positions the model knows and the pool can hold
        self.max_seq_len = min(mc.max_position_embeddings, self.num_pages * self.page_size)
        width = -(-self.max_seq_len // self.page_size) * self.page_size
        self.dummy_slot = config.max_running_requests  # the last row is the padding request's
        self.page_table = torch.zeros(
            (config.max_running_requests + 1, width), dtype=torch.int32, device=self.device
        )
        self.page_table[self.dummy_slot] = self.pool.dummy_loc
        # a row of token ids per slot; the last row is a sink for tokens that are not kept
        self.token_table = torch.zeros(
            (config.max_running_requests + 1, self.max_seq_len),
            dtype=torch.int32,
            device=self.device,
        )
        # its copy in pinned host memory, for the sampled tokens only: the sampling kernel writes
        # each one into both, and the host reads it here. A copy to the host after each step
        # held the next step back ~10 us on an H200 (benchmark/RESULTS.md)
        self.host_token_table = torch.zeros(
            self.token_table.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda"
        )
        self._host_tokens = self.host_token_table.numpy().reshape(-1)  # a view, for reads

        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.attn_backend = create_attention_backend(backend, self.pool, self.page_table)
        self.sampler = Sampler(mc.vocab_size, self.device)
        sample_counters = torch.zeros(
            config.max_running_requests, dtype=torch.int32, device=self.device
        )
        # not a bound method: the graph runner holds it, and must not keep the engine alive
        self._step = functools.partial(
            _forward_step,
            self.model,
            self.page_table,
            self.token_table,
            self.host_token_table,
            sample_counters,
        )

        if self.device.type == "cuda":
            self._warm_up_lm_head(config.max_running_requests)

        max_bs = config.cuda_graph_max_bs
        if max_bs is None:
            max_bs = config.max_running_requests if self.device.type == "cuda" else 0
        if max_bs > 0 and self.device.type == "cuda" and not self.attn_backend.supports_cuda_graph:
            logger.warning("the %s attention backend runs without CUDA graphs", backend)
            max_bs = 0
        self.graph_runner = None
        if max_bs > 0:
            self.graph_runner = GraphRunner(
                self._step,
                self.attn_backend,
                min(max_bs, config.max_running_requests),
                self.dummy_slot,
                self.page_table.shape[1],
                self.token_table.shape[1],
                self.pool.dummy_loc,
                self.device,
            )
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens, max_seq_len %d",
            mc.architecture,
            self.device,
            self.dtype,
            self.num_pages,
            self.page_size,
            self.max_seq_len,
        )

    def _init_distributed(self, config: EngineConfig) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=config.dist_init_method,
            rank=config.tp_rank,
            world_size=config.tp_size,
        )

    def _warm_up_lm_head(self, max_rows: int) -> None:
        """Run the LM head once at every row count a step can give it (one per sampled request).
        On an H200 a call at a row count new to the process cost the host ~3 ms, and in a
        prefill step, whose sampled rows grow from step to step, such calls held the host until
        the GPU had run out of work: 4.8-5.9 ms of idle GPU before most prefill steps of the
        offline benchmark (RESULTS.md). Paid here instead, as vLLM warms its kernels up."""
        lm_head, norm = self.model.lm_head, self.model.model.norm
        shape = (max_rows, self.model_config.hidden_size)
        x, residual = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        for rows in range(1, max_rows + 1):
            lm_head.logits(x[:rows], residual[:rows], norm)

    def _num_pages(self, free_before: int) -> int:
        c, mc = self.config, self.model_config
        if c.max_kv_tokens is not None:
            return -(-c.max_kv_tokens // c.page_size)
        num_kv_heads = self.model.model.layers[0].self_attn.attn.num_kv_heads
        per_token = KVPool.bytes_per_token(mc.num_layers, num_kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            used_by_model = free_before - _free_memory(self.device)
            budget = int(c.memory_fraction * free_before) - used_by_model
        else:  # host memory is shared with everything else: take a modest share
            budget = int(0.2 * free_before)
        tokens = min(budget // per_token, c.max_running_requests * mc.max_position_embeddings)
        if c.tp_size > 1:  # every rank must agree on the pool size
            t = torch.tensor([tokens], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            tokens = int(t.item())
        if tokens < c.page_size:
            raise RuntimeError(f"no memory left for the KV cache ({budget} bytes)")
        return tokens // c.page_size

    def forward_logits(self, batch: Batch) -> torch.Tensor:
        """Compute one batch; logits for each request's last token (every token if all_logits)."""
        self.attn_backend.prepare(batch)
        batch.upload(self.device)
        with get_global_ctx().forward_batch(batch, self.attn_backend):
            load_inputs(batch, self.page_table, self.token_table)
            return self.model.forward()

    def forward(self, batch: Batch, args: SamplingArgs) -> ForwardOutput:
        """Compute one batch and sample one token per request."""
        assert not batch.all_logits
        self.attn_backend.prepare(batch)
        sampling = args.in_step
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits, step_tokens = self.graph_runner.run(batch, sampling)
        else:
            batch.upload(self.device)
            with get_global_ctx().forward_batch(batch, self.attn_backend):
                logits, step_tokens = self._step(batch, sampling)
        out = self.sampler.sample(logits, step_tokens, args)
        if args.filtered:  # the tokens drawn after the step replace the ones it wrote
            self.token_table.view(-1).scatter_(0, batch.sample_entries, out.tokens)
        copies = None
        if args.filtered or args.num_logprobs >= 0:
            copies = SampleOutput(*(None if t is None else _to_host(t) for t in vars(out).values()))
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if copies is not None:
            return ForwardOutput(done, copies)
        entries = np.asarray(batch.host_inputs["sample_entries"])
        return ForwardOutput(done, host_entries=entries, host_table=self._host_tokens)


def _forward_step(
    model: CausalLM,
    page_table: torch.Tensor,
    token_table: torch.Tensor,
    host_token_table: torch.Tensor,
    sample_counters: torch.Tensor,
    batch: Batch,
    sampling: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and each row's token, already written into the token table: the part of a step
    that a CUDA graph captures. sampling: (temperatures, uniforms), a temperature of 0 marking a
    greedy row; None: every row greedy. Runs inside `forward_batch`."""
    load_inputs(batch, page_table, token_table)
    logits = model.forward()
    temperatures, uniforms = sampling if sampling is not None else (None, None)
    tokens = sample_tokens(
        logits, token_table, batch.sample_entries, sample_counters, temperatures, uniforms,
        host_token_table,
    )  # fmt: skip
    return logits, tokens


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    return t.to("cpu", non_blocking=True)


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
