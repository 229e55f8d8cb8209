"""What a TP decode step's all-reduces cost, for the TP floor: measured on the machine's own
devices, since an all-reduce of a decode step's few rows is bound by latency, not bandwidth.

Each layer ends its attention (o_proj) and its MLP (the down projection, or the experts' sum) in
an all-reduce of [rows, hidden]: 2 per layer a step. The measurement runs in `tp` fresh processes
with a process group of their own (NCCL on GPUs, one per rank, each message's all-reduces
replayed in a CUDA graph as a decode step replays them; gloo on the CPU), before the engine
starts.
"""

import multiprocessing
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from minisgl.utils.process import local_init_method

ALL_REDUCES_PER_LAYER = 2  # after o_proj and after the MLP
_CALLS = 20  # all-reduces per timed replay
_REPEATS = 5  # timed replays per message size (the median counts)
_TIMEOUT_S = 300


def _seconds_per_call(x: torch.Tensor) -> float:
    """One all-reduce of x: on a GPU replayed in a CUDA graph and timed by events; on the CPU
    by the host's clock."""
    dist.all_reduce(x)  # warm-up: the communicator's first use stays outside any graph
    if x.is_cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(_CALLS):
                dist.all_reduce(x)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        runs = []
        for _ in range(_REPEATS):
            dist.barrier()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3)
    else:
        runs = []
        for _ in range(_REPEATS):
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(_CALLS):
                dist.all_reduce(x)
            runs.append(time.perf_counter() - begin)
    return statistics.median(runs) / _CALLS


def _rank(
    rank: int,
    tp: int,
    init_method: str,
    device_type: str,
    dtype: torch.dtype,
    numels: Sequence[int],
    results: "multiprocessing.Queue[dict[int, float]]",
) -> None:
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=tp
    )
    try:
        device = torch.device(device_type, rank) if cuda else torch.device("cpu")
        seconds = {n: _seconds_per_call(torch.zeros(n, dtype=dtype, device=device)) for n in numels}
        if rank == 0:
            results.put(seconds)
    finally:
        dist.destroy_process_group()


def all_reduce_seconds(
    tp: int, device_type: str, dtype: torch.dtype, numels: Sequence[int]
) -> dict[int, float]:
    """Seconds of one all-reduce over `tp` ranks of each message size (elements of dtype)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = local_init_method()
    ranks = [
        context.Process(
            target=_rank, args=(r, tp, init_method, device_type, dtype, numels, results)
        )
        for r in range(tp)
    ]
    for process in ranks:
        process.start()
    try:
        seconds = results.get(timeout=_TIMEOUT_S)
    finally:
        for process in ranks:
            process.join(timeout=_TIMEOUT_S)
    if any(process.exitcode != 0 for process in ranks):
        raise RuntimeError(f"all-reduce timing: exit codes {[p.exitcode for p in ranks]}")
    return seconds


def decode_all_reduce_seconds(
    tp: int,
    device_type: str,
    dtype: torch.dtype,
    hidden: int,
    num_layers: int,
    rows_per_step: Sequence[int],
) -> float:
    """The all-reduces of decode steps of these row counts, each at its own size's time."""
    seconds = all_reduce_seconds(
        tp, device_type, dtype, sorted({r * hidden for r in rows_per_step})
    )
    per_step = ALL_REDUCES_PER_LAYER * num_layers
    return sum(per_step * seconds[r * hidden] for r in rows_per_step)
