"""What the offline benchmarks share: the standard workload, the copy bandwidth of the device, the
memory-bandwidth floor of a decode workload, and the side-by-side table they print.

The floor is the time a perfect engine would need if decoding were bound only by memory traffic:
every decode step reads the weights once plus the KV cache of every live request. For a mixture
of experts a step reads, of the experts, only those its tokens select: their number per layer is
the mean over the decode steps of an untimed pass of the same workload that records each step's
routing (`record_experts_per_layer`).
"""

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from collectives import decode_all_reduce_seconds
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from minisgl.config import ConfigError
from minisgl.kvcache.pool import KVPool
from minisgl.llm import LLM
from minisgl.models import ModelConfig
from minisgl.moe.recorder import recording
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import resolve_device, resolve_dtype

TOP_KERNELS = 30  # rows of a profile's kernel table
QWEN3_SHAPE = Path(__file__).resolve().parents[2] / "tests" / "assets" / "qwen3-tokenizer"
# nano-vllm's bench draws prompt ids below 10000; ids are folded into smaller vocabularies
MAX_TOKEN_ID = 10000
Row = dict[str, Any]


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)


def make_workload(
    num_requests: int,
    min_len: int,
    max_len: int,
    vocab_size: int,
    seed: int = 0,
    output_range: tuple[int, int] | None = None,
) -> Workload:
    """nano-vllm's bench workload: all prompts first (length, then ids), then all output lengths,
    drawn in that order, so seed 0 gives the standard lengths (same stream as `random.seed(0)`).
    output_range: (shortest, longest) output, if not the prompts' range."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, MAX_TOKEN_ID) % vocab_size for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]
    min_out, max_out = output_range or (min_len, max_len)
    output_lens = [rng.randint(min_out, max_out) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(fn's result, wall seconds), with the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


@contextmanager
def triton_compiles() -> Iterator[Counter[str]]:
    """Counts Triton kernel builds inside the block by kernel name and kind: 'compiled' (JIT) or
    'disk cache' (loaded from Triton's on-disk cache). Any inside a timed run means build time was
    timed."""
    counts: Counter[str] = Counter()
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than its compilation listener (3.4)
        yield counts
        return

    def listener(*, src: Any, cache_hit: bool, **_: Any) -> None:
        counts[f"{getattr(src, 'name', src)} ({'disk cache' if cache_hit else 'compiled'})"] += 1

    previous = knobs.compilation.listener
    knobs.compilation.listener = listener
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written), the median of `repeats` copies."""
    if nbytes is None:  # far beyond any cache; smaller on the host to keep smoke runs quick
        nbytes = 1 << 30 if device.type == "cuda" else 1 << 27
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch page faults, lazy driver init
    seconds = [device_seconds(lambda: dst.copy_(src), device) for _ in range(repeats)]
    return 2 * nbytes / statistics.median(seconds)


def device_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of `fn` keeps the device busy: CUDA events around it on a GPU (no host
    time in the figure), the host's clock after a synchronize elsewhere."""
    if device.type != "cuda":
        return timed(fn, device)[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def model_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of all weights, KV bytes per token) of the engine's model; a tied weight counts once.
    Under TP, rank 0's share: every rank reads its own at the same time, from its own memory."""
    mc = llm.engine.model_config
    kv_per_token = KVPool.bytes_per_token(
        mc.num_layers, llm.engine.num_kv_heads, mc.head_dim, llm.engine.dtype
    )
    return llm.engine.weight_bytes, kv_per_token


def step_weight_bytes(llm: LLM, experts_per_layer: float | None) -> int:
    """Bytes of weights a decode step reads: all of them (a tied weight once) but an untied
    embedding table, of which a step gathers only its tokens' rows (counted whole, it added
    10 % to Qwen3-30B-A3B's one-request floor); for a mixture of experts all but the experts,
    plus `experts_per_layer` experts of each sparse layer."""
    weight_bytes, _ = model_bytes(llm)
    mc = llm.engine.model_config
    if not mc.tie_word_embeddings:  # else the LM head reads the whole table
        table = llm.engine.model.state_dict()["model.embed_tokens.weight"]
        weight_bytes -= table.numel() * table.element_size()
    if mc.moe is None or experts_per_layer is None:
        return weight_bytes
    experts = sum(
        t.numel() * t.element_size()
        for name, t in llm.engine.model.state_dict().items()
        if ".mlp.experts." in name
    )
    per_expert = experts / (len(mc.moe.layers) * mc.moe.num_experts)
    return round(weight_bytes - experts + experts_per_layer * len(mc.moe.layers) * per_expert)


def describe_weights(llm: LLM, step_bytes: int, experts_per_layer: float | None) -> str:
    """The weights' size, what a decode step reads of them, and for a mixture of experts how
    many experts."""
    weight_bytes, _ = model_bytes(llm)
    read = f"weights {weight_bytes / 1e6:,.1f} MB, {step_bytes / 1e6:,.1f} MB of them read per step"
    moe = llm.engine.model_config.moe
    if moe is None or experts_per_layer is None:
        return read
    return f"{read} ({experts_per_layer:.1f} of {moe.num_experts} experts per sparse layer)"


def floor_bytes(
    prompt_lens: Sequence[int], output_lens: Sequence[int], weight_bytes: int, kv_per_token: int
) -> int:
    """Bytes a decode-bound run must read when all requests start together: each step reads
    weight_bytes (`step_weight_bytes`), and request i at its step t (1..o_i) reads p_i + t tokens
    of KV."""
    steps = max(output_lens)
    # sum over t = 1..o of (p + t) = o * p + o * (o + 1) / 2
    kv_tokens = sum(o * p + o * (o + 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True))
    return steps * weight_bytes + kv_tokens * kv_per_token


def floor_row(
    name: str,
    workload: Workload,
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
    all_reduce_s: float = 0.0,
) -> Row:
    """The bandwidth floor, plus under TP the decode steps' all-reduces (`tp_all_reduce_seconds`)."""
    seconds = (
        floor_bytes(workload.prompt_lens, workload.output_lens, weight_bytes, kv_per_token)
        / bandwidth
    )
    return bound_row(name, workload, seconds + all_reduce_s)


def tp_all_reduce_seconds(
    args: argparse.Namespace, device: torch.device, output_lens: Sequence[int]
) -> float:
    """The all-reduces of a run's decode steps at --tp ranks (0 at one), all its requests
    starting together as the floor has them: step t holds the requests with outputs >= t."""
    if args.tp == 1:
        return 0.0
    mc = ModelConfig.from_hf(cached_load_hf_config(args.model))
    rows = [sum(o >= step for o in output_lens) for step in range(1, max(output_lens) + 1)]
    dtype = resolve_dtype(args.dtype, device)
    return decode_all_reduce_seconds(
        args.tp, device.type, dtype, mc.hidden_size, mc.num_layers, rows
    )


def bound_row(name: str, workload: Workload, seconds: float) -> Row:
    """The row of a lower bound on the workload's time; all requests decode together, so the run
    takes as many steps as the longest output."""
    return result_row(
        name,
        len(workload.prompts),
        workload.prompt_tokens,
        workload.output_tokens,
        seconds,
        steps=max(workload.output_lens),
    )


def result_row(
    name: str,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    seconds: float,
    steps: int | None = None,
) -> Row:
    """One line of the table; steps: forward steps taken, where known."""
    return {
        "system": name,
        "requests": requests,
        "output_tokens": output_tokens,
        "steps": steps,
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (prompt_tokens + output_tokens) / seconds,
    }


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def print_table(rows: Sequence[Row]) -> None:
    """One column per key of the first row, one line per row; absent values print as '-'."""
    headers = list(rows[0])
    cells = [headers] + [[format_value(row.get(h)) for h in headers] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    for line in cells:  # names left-aligned, numbers right-aligned
        padded = [
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        print("  ".join(padded))


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """The payload, with where and when it was measured (as RESULTS.md records each figure)."""
    if path is not None:
        Path(path).write_text(json.dumps({"provenance": provenance(), **payload}, indent=2) + "\n")


def provenance() -> dict[str, Any]:
    """The date, the commit (None outside a git checkout, as on the device's copy of the tree),
    whether the tree differed from it, and the machine."""
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        except OSError:  # no git on this machine
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no"))
        if commit
        else None,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def run_device(name: str) -> torch.device:
    """The device a run names; exits in one line where there is none (CUDA, the default, on a
    machine without it)."""
    try:
        return resolve_device(name)
    except ConfigError as e:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {e} (--device cpu runs on the CPU)") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags both scripts share: the model, where it runs, and the engine ablations."""
    parser.add_argument(
        "--model", default=str(QWEN3_SHAPE), help="model directory (weights are random)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, a GPU each")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--moe-backend", default="auto")
    parser.add_argument("--no-cuda-graph", action="store_true", help="cuda_graph_max_bs=0")
    parser.add_argument("--no-overlap", action="store_true", help="no overlap scheduling")
    parser.add_argument("--json", help="also write the results here")


def chunk_setting(args: argparse.Namespace) -> dict[str, int]:
    """--chunk-size if given, else the offline API's default."""
    return {} if args.chunk_size is None else {"chunk_size": args.chunk_size}


def build_llm(args: argparse.Namespace, **kwargs: Any) -> LLM:
    """The engine under test, with dummy weights: the values do not change the speed. kwargs:
    more settings, or other values for these."""
    settings = {
        "device": args.device,
        "dtype": args.dtype,
        "tp_size": args.tp,
        "page_size": args.page_size,
        "attention_backend": args.attention_backend,
        "moe_backend": args.moe_backend,
        "cuda_graph_max_bs": 0 if args.no_cuda_graph else None,
        "overlap": not args.no_overlap,
        "dummy_weights": True,
    }
    return LLM(args.model, **{**settings, **kwargs})


def free_device_memory(device: torch.device) -> None:
    gc.collect()  # the engine's reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def record_experts_per_layer(
    args: argparse.Namespace, run: Callable[[LLM], Any], **kwargs: Any
) -> float | None:
    """Distinct experts per sparse layer and decode step in run(llm), on an engine of its own
    (build_llm's, with kwargs) without CUDA graphs, since a replayed graph runs no Python to
    record with; the engine is gone when this returns, before the timed one is built. None for a
    dense model."""
    if ModelConfig.from_hf(cached_load_hf_config(args.model)).moe is None:
        return None
    llm = build_llm(args, **{**kwargs, "cuda_graph_max_bs": 0})
    with recording() as recorder:
        run(llm)
    experts_per_layer = recorder.mean_selected()
    device = llm.engine.device
    del llm
    free_device_memory(device)
    return experts_per_layer


def device_profiler(device: torch.device) -> profile:
    """A profiler of the device's kernels (of the host's ops on a CPU)."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    return profile(activities=[activity])


def print_profile(
    prof: profile, device: torch.device, seconds: float, steps: int
) -> dict[str, Any]:
    """The kernels (CPU ops on the host) with the most total time, and the time per step,
    printed and returned."""
    if device.type == "cuda":
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        time_us = {e.key: e.self_device_time_total for e in events}
    else:
        events = list(prof.key_averages())
        time_us = {e.key: e.self_cpu_time_total for e in events}
    busy_us = sum(time_us.values())
    if busy_us == 0:
        raise RuntimeError("the profiler recorded no device activity")
    events.sort(key=lambda e: time_us[e.key], reverse=True)
    kernels = [
        {
            "kernel": e.key if len(e.key) <= 70 else e.key[:67] + "...",
            "calls": e.count,
            "total_ms": time_us[e.key] / 1e3,
            "share_%": 100 * time_us[e.key] / busy_us,
        }
        for e in events[:TOP_KERNELS]
    ]
    # wall minus busy per step is the time the device waited on the host (scheduling, launches)
    per_step = {
        "steps": steps,
        "wall_ms_per_step": 1e3 * seconds / steps,
        "busy_ms_per_step": busy_us / 1e3 / steps,
        "busy_%_of_wall": 100 * busy_us / 1e6 / seconds,
    }
    print()
    print_table(kernels)
    print_table([per_step])
    return {"kernels": kernels, "per_step": per_step}
