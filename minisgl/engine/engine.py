"""Engine = model + KV pool + attention backend + sampler (+ MoE backend, CUDA graphs).

It computes a batch and returns sampled tokens; it never changes a request. It allocates the two
device tables a batch reads, the page table and the token table, but their entries are decided
by the scheduler (its KV cache manager and token table) and written with each batch, except the
page table's dummy row set up here. The one thing a step writes back is each sampled token, into
the token-table entry the batch names: that is how the next step reads it without the host. The
same entry of the table's pinned host copy is where the host reads it.
"""

import functools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.attention.base import AttentionBackend
from minisgl.config import (
    ConfigError,
    EngineConfig,
    check_kv_capacity,
    check_table_size,
    kv_pages,
    max_seq_len,
    page_table_width,
)
from minisgl.core import Batch, BatchInputs, EngineLayout
from minisgl.distributed import broadcast, set_tp_info
from minisgl.kernel import sample_tokens
from minisgl.kvcache.pool import KVPool
from minisgl.layers.linear import local_kv_heads
from minisgl.models import CausalLM, ModelConfig, build_model, load_model_weights, weight_bytes
from minisgl.moe import MOE_BACKENDS
from minisgl.utils import init_logger
from minisgl.utils.cpus import usable_cpus
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.host_memory import keep_freed_memory
from minisgl.utils.torch_utils import (
    PinnedStaging,
    pack_to_device,
    resolve_device,
    resolve_dtype,
)

from .context import ForwardBatch, forward_context, load_inputs
from .graph import GraphRunner
from .sampler import SampleOutput, Sampler, token_logprobs

logger = init_logger(__name__)
_GPU_MEMORY_UTILIZATION = 0.85  # a GPU's default share of its free memory, for weights + KV
_CPU_KV_SHARE = 0.2  # the CPU's default, for the KV cache: its memory is everyone else's too


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
        start = time.monotonic()
        self.config = config
        self.device = _init_device(config)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = ModelConfig.from_hf(cached_load_hf_config(config.model_path))
        self.num_kv_heads = local_kv_heads(self.model_config.num_kv_heads, config.tp_size)
        self.moe_backend_name = MOE_BACKENDS.resolve(config.moe_backend, self.device.type)
        self.moe_backend = MOE_BACKENDS.get(self.moe_backend_name)()
        free_before = _free_memory(self.device)
        self.model = build_model(self.model_config, self.device, self.dtype, self.moe_backend)
        self.weight_bytes = weight_bytes(self.model)
        self._check_weights_fit(free_before)
        load_model_weights(
            self.model, config.model_path, self.model_config, self.device, self.dtype,
            config.dummy_weights,
        )  # fmt: skip
        seq_len = max_seq_len(config, self.model_config.max_position_embeddings)
        self.pool = self._build_pool(free_before, seq_len)
        self._build_tables(seq_len)
        self.attn_backend_name = ATTENTION_BACKENDS.resolve(
            config.attention_backend, self.device.type
        )
        self.attn_backend = ATTENTION_BACKENDS.get(self.attn_backend_name)(
            self.pool, self.page_table
        )
        self.sampler = Sampler(self.model_config.vocab_size, self.device, self.token_table)
        sample_counters = torch.zeros(
            config.max_running_requests, dtype=torch.int32, device=self.device
        )
        # TP ranks take rank 0's tokens after the step (`forward`), not the ones they sampled
        host_table = self.host_token_table if config.tp_size == 1 else None
        # not a bound method: the graph runner holds it, and must not keep the engine alive
        self._step = functools.partial(
            _forward_step, self.model, self.attn_backend, self.page_table, self.token_table,
            host_table, sample_counters,
        )  # fmt: skip
        self.layout = EngineLayout(
            num_pages=self.pool.num_pages,
            page_size=config.page_size,
            num_slots=config.max_running_requests,
            page_table_width=self.page_table.shape[1],
            token_table_width=self.token_table.shape[1],
            max_seq_len=seq_len,
            vocab_size=self.model_config.vocab_size,
        )
        if self.device.type == "cuda":
            self._warm_up_lm_head(config.max_running_requests)
        self.graph_runner = self._capture_graphs()
        self.build_seconds = time.monotonic() - start

    def summary(self) -> list[str]:
        """What was built, for the operator: a line each."""
        mc, c, layout = self.model_config, self.config, self.layout
        if self.graph_runner is None:
            graphs = "CUDA graphs off"
        elif self.device.type == "cuda":
            graphs = f"CUDA graphs for batches {self.graph_runner.sizes}"
        else:  # the runner pads decode batches to its sizes and captures nothing
            graphs = f"decode batches padded to {self.graph_runner.sizes} (no graphs on the CPU)"
        return [
            f"model {c.model_path} ({mc.architecture}{', dummy weights' if c.dummy_weights else ''}"
            f"), {str(self.dtype).removeprefix('torch.')} on {self.device}, TP {c.tp_size}",
            f"weights {self.weight_bytes / 2**30:.2f} GiB; KV cache "
            f"{layout.num_pages * layout.page_size:,} tokens in {layout.num_pages:,} pages of "
            f"{layout.page_size}",
            f"max model length {layout.max_seq_len:,}; up to {c.max_running_requests} running "
            f"requests; attention {self.attn_backend_name}"
            f"{f'; MoE {self.moe_backend_name}' if mc.moe is not None else ''}"
            f"; {graphs}",
            f"built in {self.build_seconds:.1f} s",
        ]

    def close(self) -> None:
        """Leave the TP group, if any, so that a later engine in this process may join one. The
        graphs go first: NCCL's finalize waits until no CUDA graph holds a collective of the
        group, so with them alive it never returns."""
        if self.config.tp_size > 1:
            if self.graph_runner is not None:
                self.graph_runner.release()
            dist.destroy_process_group()

    # ------------------------------------------------------------------ building
    def _check_weights_fit(self, free: int) -> None:
        """What could never fit, in one line: torch's allocation error is a traceback, and on
        the CPU the kernel's OOM killer may end other processes first. A CPU's ranks on one
        machine share its memory."""
        cpu = self.device.type == "cpu"
        ranks = self.config.ranks_per_node if cpu else 1
        need = self.weight_bytes * ranks
        room = _host_memory() if cpu else free
        if need > room:
            shares = f" ({ranks} ranks of {self.weight_bytes / 2**30:.1f} GiB)" if ranks > 1 else ""
            raise ConfigError(
                f"the weights need {need / 2**30:.1f} GiB{shares}, more than the "
                f"{room / 2**30:.1f} GiB " + ("of this machine" if cpu else "free on the GPU")
            )

    def _build_pool(self, free_before: int, seq_len: int) -> KVPool:
        c, mc = self.config, self.model_config
        per_token = KVPool.bytes_per_token(
            mc.num_layers, self.num_kv_heads, mc.head_dim, self.dtype
        )
        if c.max_kv_tokens is not None:
            tokens = c.max_kv_tokens
            # what could never fit, in one line (torch's allocation error is a traceback)
            room = _free_memory(self.device) if self.device.type == "cuda" else _host_memory()
            if tokens * per_token > room:
                raise ConfigError(
                    f"--max-kv-tokens {tokens}: its KV cache needs {tokens * per_token / 2**30:.1f}"
                    f" GiB, more than the {room / 2**30:.1f} GiB "
                    + ("free on the GPU" if self.device.type == "cuda" else "of this machine")
                )
        else:
            if self.device.type == "cuda" or c.gpu_memory_utilization is not None:
                # at least 0: on the CPU, memory other processes give back while the model loads
                # raised the free figure once, and a share too small to hold a request built
                used_by_model = max(0, free_before - _free_memory(self.device))
                share = c.gpu_memory_utilization or _GPU_MEMORY_UTILIZATION
                budget = int(share * free_before) - used_by_model
            else:
                budget = int(_CPU_KV_SHARE * free_before)
            tokens = min(budget // per_token, c.max_running_requests * seq_len)
        if c.tp_size > 1:  # every rank must agree on the pool size
            t = torch.tensor([tokens], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            tokens = int(t.item())
        num_pages = kv_pages(tokens, c.page_size)
        check_kv_capacity(num_pages, c.page_size, seq_len)
        return KVPool(
            mc.num_layers, num_pages, c.page_size, self.num_kv_heads, mc.head_dim, self.dtype,
            self.device,
        )  # fmt: skip

    def _build_tables(self, seq_len: int) -> None:
        check_table_size(self.config.max_running_requests, self.config.page_size, seq_len)
        rows = self.config.max_running_requests + 1  # the last row: padding request / sink
        width = page_table_width(seq_len, self.config.page_size)
        self.page_table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        self.page_table[-1] = self.pool.dummy_loc
        self.token_table = torch.zeros((rows, seq_len), dtype=torch.int32, device=self.device)
        # its copy in pinned host memory, for the sampled tokens only: the sampling kernel writes
        # each one into both, and the host reads it here. A copy to the host after each step
        # held the next step back ~10 us on an H200
        self.host_token_table = torch.zeros(
            self.token_table.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda"
        )
        self._host_tokens = self.host_token_table.numpy().reshape(-1)  # a view, for reads
        self._staging = PinnedStaging() if self.device.type == "cuda" else None  # eager inputs

    def _warm_up_lm_head(self, max_rows: int) -> None:
        """Run the LM head once at every row count a step can give it (one per sampled request).
        On an H200 a cuBLAS call at a row count new to the process cost the host ~3 ms, and in a
        prefill step such calls held the host until the GPU had run out of work."""
        lm_head, norm = self.model.lm_head, self.model.model.norm
        shape = (max_rows, self.model_config.hidden_size)
        x, residual = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        for rows in range(1, max_rows + 1):
            lm_head.logits(x[:rows], residual[:rows], norm)

    def _capture_graphs(self) -> GraphRunner | None:
        c = self.config
        max_bs = c.cuda_graph_max_bs
        if max_bs is None:
            max_bs = c.max_running_requests if self.device.type == "cuda" else 0
        blockers = []
        if not self.attn_backend.supports_cuda_graph:
            blockers.append(f"the {self.attn_backend_name} attention backend")
        if self.model_config.moe is not None and not self.moe_backend.supports_cuda_graph:
            blockers.append(f"the {self.moe_backend_name} MoE backend")
        if max_bs > 0 and self.device.type == "cuda" and blockers:
            logger.warning("%s: no CUDA graphs", " and ".join(blockers))
            max_bs = 0
        if max_bs == 0:
            return None
        return GraphRunner(
            self._step,
            min(max_bs, c.max_running_requests),
            self.layout,
            self.pool.dummy_loc,
            self.device,
        )

    # ------------------------------------------------------------------ computing
    def forward(self, batch: Batch) -> ForwardOutput:
        """Compute one batch and sample one token per request."""
        args = self.sampler.prepare(batch)
        sampling = args.in_step
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits, step_tokens, inputs = self.graph_runner.run(batch, sampling)
        else:
            inputs = upload(batch.inputs, self.device, self._staging)
            metadata = self.attn_backend.prepare(batch)
            logits, step_tokens = self._step(batch.is_decode, inputs, metadata, sampling)
        num_reqs = len(batch.reqs)
        out = self.sampler.sample(logits[:num_reqs], step_tokens, args)
        if batch.prompt_spans:
            num_top = max(
                batch.reqs[i].params.prompt_logprobs or 0 for i, _, _ in batch.prompt_spans
            )
            (out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs, out.prompt_ranks) = (
                token_logprobs(logits[num_reqs:], inputs.prompt_targets, num_top, ranks=True)
            )
        tp = self.config.tp_size > 1
        if tp:  # every rank takes rank 0's: seeds or logits that differ in a bit must not fork them
            broadcast(out.tokens)
        if args.after_step or tp:  # these tokens replace the ones the step wrote
            self.token_table.view(-1).scatter_(0, inputs.sample_entries, out.tokens)
        copies = None
        if args.after_step or tp or args.num_logprobs >= 0 or batch.prompt_spans:
            copies = SampleOutput(*(None if t is None else _to_host(t) for t in vars(out).values()))
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if copies is not None:
            return ForwardOutput(done, copies)
        entries = np.asarray(batch.inputs.sample_entries)
        return ForwardOutput(done, host_entries=entries, host_table=self._host_tokens)


def upload(
    host: BatchInputs, device: torch.device, staging: PinnedStaging | None = None
) -> BatchInputs[torch.Tensor]:
    """A batch's host inputs on the device, in one transfer (through `staging` where given)."""
    return BatchInputs(**pack_to_device(device, torch.int32, staging, **vars(host)))


def _forward_step(
    model: CausalLM,
    attn_backend: AttentionBackend,
    page_table: torch.Tensor,
    token_table: torch.Tensor,
    host_token_table: torch.Tensor | None,
    sample_counters: torch.Tensor,
    is_decode: bool,
    inputs: BatchInputs[torch.Tensor],
    attn_metadata: object,
    sampling: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (each request's row, then a prefill's prompt-logprob rows) and each request's
    token, already written into the token table: the part of a step that a CUDA graph captures.
    sampling: (temperatures, uniforms), a temperature of 0 marking a greedy row; None: every row
    greedy."""
    input_ids, out_loc = load_inputs(inputs, page_table, token_table)
    with forward_context(ForwardBatch(is_decode, inputs, out_loc, attn_backend, attn_metadata)):
        logits = model.forward(input_ids)
    temperatures, uniforms = sampling if sampling is not None else (None, None)
    rows = logits[: inputs.sample_entries.shape[0]]  # each request's; prompt-logprob rows follow
    tokens = sample_tokens(
        rows, token_table, inputs.sample_entries, sample_counters, temperatures, uniforms,
        host_token_table,
    )  # fmt: skip
    return logits, tokens


def _init_device(config: EngineConfig) -> torch.device:
    """This rank's device, TP group, and on the CPU its threads and malloc."""
    device = resolve_device(config.device)
    if device.type == "cuda" and config.tp_size > 1:
        device = torch.device("cuda", config.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_tp_info(config.tp_rank, config.tp_size)
    if config.tp_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=config.dist_init_method,
            rank=config.tp_rank,
            world_size=config.tp_size,
        )
    if device.type == "cpu":
        torch.set_num_threads(max(1, usable_cpus() // config.ranks_per_node))
        keep_freed_memory()
    torch.manual_seed(0)  # dummy weights: the same random model in every run
    return device


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    return t.to("cpu", non_blocking=True)


def _host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
