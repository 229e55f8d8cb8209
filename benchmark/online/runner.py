"""One benchmark: the server (ours launched, or any at a URL), a warm-up, one run per request rate
(or the trace's own arrivals), then the offline run once the server has exited, and the report."""

import argparse
import asyncio
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import httpx
from api import ENDPOINTS, Prompt, api_prompt, request_body
from client import run_clients, send_together, split_jobs
from common import write_json
from offline import OfflineJob, engine_overrides, run_offline
from report import plot, print_report
from server import LaunchedServer, free_port
from server_metrics import cache_delta, scrape
from serving_metrics import count_text_tokens, parse_slos, summarize
from tqdm import tqdm
from transformers import AutoTokenizer
from workload import (
    BenchRequest,
    arrivals,
    load_trace,
    random_workload,
    shared_prefix_workload,
    shifted,
)

from minisgl.server.args import ServerArgs
from minisgl.server.cli import parse_args as parse_server_args
from minisgl.utils import resolve_model_path
from minisgl.utils.hf import cached_load_hf_config

WARMUP_TOKENS = 16


def rate_label(rate: float) -> float | str:
    """A request rate as JSON can hold it (vLLM writes an infinite rate as "inf")."""
    return "inf" if rate == float("inf") else rate


def build_workload(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    if args.workload == "trace":
        return load_trace(Path(args.trace), vocab_size, args.seed, args.trace_block_size)
    lengths = (args.num_requests, args.min_len, args.max_len, vocab_size, args.seed)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(*lengths, args.prefix_len)
    return random_workload(*lengths)


def served_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model GET /v1/models lists."""
    response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30, trust_env=False)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


class Benchmark:
    """The settings every run shares: where to send, what, and how."""

    def __init__(self, args: argparse.Namespace, server_argv: list[str]) -> None:
        self.args = args
        self.slos = parse_slos(args.goodput)
        self.server: ServerArgs | None = None
        self.launched: LaunchedServer | None = None
        if args.launch:
            port = args.port or free_port()
            given = [
                ("--model", args.model),
                ("--api-key", args.api_key),
                ("--served-model-name", args.served_model_name),
            ]
            extra = [arg for flag, value in given if value is not None for arg in (flag, value)]
            # ours last: the tool chooses where the server listens
            argv = [*server_argv, *extra, "--host", "127.0.0.1", "--port", str(port)]
            self.server = parse_server_args(argv)
            self.base_url = f"http://127.0.0.1:{port}"
            log = args.server_log or Path(tempfile.gettempdir()) / f"bench_serving_{port}.log"
            self.launched = LaunchedServer(argv, self.base_url, Path(log), args.server_timeout)
            self.model_path = self.server.engine.model_path
            api_key = self.server.api_key
        else:
            self.base_url = args.base_url.rstrip("/")
            self.model_path = resolve_model_path(args.model)
            api_key = args.api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # checked before anything starts: a server that --offline cannot mirror is refused
        self.overrides = engine_overrides(self.server) if args.offline and self.server else None
        self.url = self.base_url + ENDPOINTS[args.endpoint]
        self.vocab_size = cached_load_hf_config(self.model_path).vocab_size
        self.requests = build_workload(args, self.vocab_size)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.rates: list[float | None] = (
            [None] if args.workload == "trace" else sorted(args.request_rate)
        )

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str), "one sequence decodes to one text"
        return text

    def prompts(self, shift: int) -> list[Prompt]:
        """The API prompts of the workload shifted by `shift` (see `workload.shifted`)."""
        text = self.args.prompt_format == "text"
        requests = shifted(self.requests, shift, self.vocab_size)
        return [api_prompt(r, self.args.endpoint, text, self.decode) for r in requests]

    def bodies(self, model: str, prompts: list[Prompt], output_lens: list[int]) -> list[dict]:
        return [
            request_body(self.args.endpoint, model, p, n, self.args.temperature)
            for p, n in zip(prompts, output_lens, strict=True)
        ]

    def warmup(self) -> list[tuple[Prompt, int]]:
        """(prompt, output length) of the warm-up requests, sent together: the first requests,
        so that the batch shapes and allocations the runs need are made before them (as the
        offline benchmark warms up), shifted past every run's shift so no run finds them cached."""
        prompts = self.prompts(len(self.rates))[: self.args.warmup]
        return [(p, WARMUP_TOKENS) for p in prompts]

    def run_rate(self, model: str, shift: int, rate: float | None) -> dict[str, Any]:
        """One run: the workload (shifted by `shift`) at `rate`, or at the trace's arrivals."""
        args, requests = self.args, self.requests
        if rate is None:
            times = [r.arrival_s or 0.0 for r in requests]
        else:
            times = arrivals(len(requests), rate, args.burstiness, args.seed)
        output_lens = [r.output_len for r in requests]
        bodies = self.bodies(model, self.prompts(shift), output_lens)
        sends = [(i, times[i], body) for i, body in enumerate(bodies)]
        jobs = split_jobs(
            self.url, self.headers, sends, args.num_client_procs, args.max_concurrency
        )
        label = "trace" if rate is None else rate_label(rate)
        before = scrape(self.base_url, self.headers)
        with tqdm(total=len(sends), desc=f"request rate {label}", disable=args.no_progress) as bar:
            start, reports = run_clients(jobs, args.max_concurrency, bar.update)
        after = scrape(self.base_url, self.headers)
        results = sorted((r for report in reports for r in report.results), key=lambda r: r.index)
        count_text_tokens(
            results, lambda text: self.tokenizer.encode(text, add_special_tokens=False)
        )
        duration = max(r.start + r.latency for r in results) - start
        prompt_lens = [len(r.prompt) for r in requests]
        busy = [report.busy_share for report in reports]
        short = sum(r.ok and r.output_tokens < output_lens[r.index] for r in results)
        return {
            "request_rate": label,
            "max_concurrency": args.max_concurrency,
            **summarize(results, prompt_lens, duration, self.slos),
            "requested_output_tokens": sum(output_lens),
            "short_outputs": short,  # completed with fewer tokens than asked (EOS not ignored?)
            "prefix_cache": cache_delta(before, after),
            "client": {"processes": len(jobs), "busy_shares": busy, "max_busy_share": max(busy)},
            "online_offline_ratio": None,
        }

    def run_all(self) -> tuple[str, list[dict[str, Any]]]:
        """(the served model's name, one record a rate) against a server that is up."""
        model = self.args.served_model_name or served_model(self.base_url, self.headers)
        warmup = self.warmup()
        bodies = self.bodies(model, [p for p, _ in warmup], [n for _, n in warmup])
        for result in asyncio.run(send_together(self.url, self.headers, bodies)):
            if not result.ok:
                raise RuntimeError(f"the warm-up request failed: {result.error}")
        return model, [self.run_rate(model, i, rate) for i, rate in enumerate(self.rates)]


def run(args: argparse.Namespace, server_argv: list[str]) -> dict[str, Any]:
    bench = Benchmark(args, server_argv)
    launched = bench.launched
    if launched is not None:
        print(f"starting {' '.join(launched.command)} (log: {launched.log_path})")
    with launched or nullcontext():
        model, runs = bench.run_all()
    offline = None
    if bench.overrides is not None:  # the server has exited: the device is free
        job = OfflineJob(
            bench.model_path,
            bench.overrides,
            bench.prompts(0),
            [r.output_len for r in bench.requests],
            args.temperature,
            bench.warmup(),
        )
        offline = run_offline(job)
        for record in runs:
            record["online_offline_ratio"] = (
                record["output_throughput"] / offline["output_throughput"]
            )
    print_report(runs, offline)
    payload = {
        "benchmark": "online serving",
        "args": {**vars(args), "request_rate": [rate_label(r) for r in args.request_rate or []]},
        "server_command": launched.command if launched else None,
        "server_log": str(launched.log_path) if launched else None,
        "base_url": bench.base_url,
        "endpoint": ENDPOINTS[args.endpoint],
        "model": model,
        "model_path": str(bench.model_path),
        "workload": {
            "kind": args.workload,
            "requests": len(bench.requests),
            "prompt_tokens": sum(len(r.prompt) for r in bench.requests),
            "output_tokens": sum(r.output_len for r in bench.requests),
        },
        "goodput_slos_ms": bench.slos,
        "runs": runs,
        "offline": offline,
    }
    write_json(args.result_json, payload)
    if args.plot:
        plot(runs, Path(args.plot))
    return payload
