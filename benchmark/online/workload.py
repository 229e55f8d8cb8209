"""What the benchmark sends and when: each request's prompt ids and output length, and its arrival.

Three workloads: nano-vllm's random lengths (the offline benchmark's own `make_workload`, so the
online and offline runs send the same requests), the same requests behind one shared prefix (a
long system prompt), and a replay of a JSONL trace in Mooncake's format, one request a line:

    {"timestamp": 27482, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}

`timestamp` is the arrival in milliseconds (counted from the first line's); `hash_ids` (optional)
name the prompt's blocks of `block_size` tokens: the same id is the same block, so requests share
the prefixes the trace says they share. All prompt ids are random, drawn as nano-vllm draws them.
"""

import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from common import make_workload


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    prefix_len: int = 0  # leading prompt ids shared with the other requests (a system prompt)
    arrival_s: float | None = None  # seconds after the start of the run; traces only


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    """n prompt ids, drawn as nano-vllm's bench draws them."""
    return make_workload(1, n, n, vocab_size, seed).prompts[0]


def random_workload(
    num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    w = make_workload(num_requests, min_len, max_len, vocab_size, seed)
    return [BenchRequest(p, n) for p, n in zip(w.prompts, w.output_lens, strict=True)]


def shared_prefix_workload(
    num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int, prefix_len: int
) -> list[BenchRequest]:
    """The random workload, every prompt behind the same `prefix_len` ids."""
    prefix = random_ids(prefix_len, vocab_size, seed + 1)
    requests = random_workload(num_requests, min_len, max_len, vocab_size, seed)
    return [BenchRequest(prefix + r.prompt, r.output_len, prefix_len) for r in requests]


def load_trace(path: Path, vocab_size: int, seed: int, block_size: int = 512) -> list[BenchRequest]:
    """The requests of a trace file, in order of arrival."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            entry = json.loads(line)
            lengths = [entry.get(k) for k in ("input_length", "output_length")]
            if not isinstance(entry.get("timestamp"), (int, float)) or not all(
                isinstance(n, int) and n >= 1 for n in lengths
            ):
                raise ValueError(
                    f"{path}:{number}: needs a timestamp and an input_length and output_length >= 1"
                )
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no requests")
    entries.sort(key=lambda e: e["timestamp"])
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    requests = []
    for entry in entries:
        prompt: list[int] = []
        for h in entry.get("hash_ids", []):
            if h not in blocks:
                blocks[h] = random_ids(block_size, vocab_size, rng.getrandbits(64))
            prompt += blocks[h]
        length = entry["input_length"]
        prompt = prompt[:length] + random_ids(
            max(0, length - len(prompt)), vocab_size, rng.getrandbits(64)
        )
        arrival_s = (entry["timestamp"] - entries[0]["timestamp"]) / 1000
        requests.append(BenchRequest(prompt, entry["output_length"], arrival_s=arrival_s))
    return requests


def shifted(requests: list[BenchRequest], shift: int, vocab_size: int) -> list[BenchRequest]:
    """The requests with every prompt id moved by `shift` (mod the vocabulary): the same lengths
    and the same cost, but no prefix in common with the unshifted prompts. Each run against one
    server sends its own shift, so that no run finds an earlier run's prompts in the prefix
    cache."""
    return [replace(r, prompt=[(t + shift) % vocab_size for t in r.prompt]) for r in requests]


def arrivals(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival times in seconds, drawn as vLLM's `bench serve` draws them: gaps of mean 1/rate
    from a gamma distribution of shape `burstiness` (1: a Poisson process; below 1 burstier,
    above 1 steadier; inf: even gaps), one before the first request too, scaled so that the last
    arrives at num_requests / rate: every seed offers exactly `rate`. An infinite rate sends
    every request at once."""
    if rate == math.inf:
        return [0.0] * num_requests
    rng = random.Random(seed)
    gaps = [
        1 / rate
        if burstiness == math.inf
        else rng.gammavariate(burstiness, 1 / (rate * burstiness))
        for _ in range(num_requests)
    ]
    times = list(itertools.accumulate(gaps))
    if not times or times[-1] == 0:  # no request, or gaps that all rounded to 0
        return times
    scale = num_requests / rate / times[-1]
    return [t * scale for t in times]
