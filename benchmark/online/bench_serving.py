"""Online serving benchmark: streamed requests to an OpenAI-compatible server, with the metrics of
vLLM's `bench serve` (request/s, output tok/s, TTFT, TPOT, ITL, E2E latency, goodput) and the
prefix-cache hit rate of each run, at each request rate given.

Workload: nano-vllm's by default (256 requests, prompt and output lengths uniform in 100-1024,
seed 0, random prompt ids, ignore_eos, temperature 0.6), the same requests behind a shared prefix,
or a JSONL trace (workload.py). Arrivals offer each --request-rate, spread as vLLM's are (Poisson,
or gamma gaps of shape --burstiness; inf: all at once), optionally capped at --max-concurrency in
flight over all clients; the client runs in --num-client-procs processes and reports how busy
each was. Each run after the first sends the prompts shifted in the
vocabulary (the same lengths), so that none finds an earlier run's prompts in the prefix cache; a
second invocation against the same server does find them (the hit rate shows it).

    # our server, launched here (arguments after -- go to `python -m minisgl`), then the same
    # requests offline through LLM.generate with the same engine settings, after it has exited
    python benchmark/online/bench_serving.py --launch --offline \
        --model tests/assets/qwen3-tokenizer --request-rate 8 16 32 inf \
        --result-json online.json --plot online.png -- --dummy-weights

    # any OpenAI-compatible server (vLLM, SGLang, ...): --model is the local directory of the
    # served model, for its vocabulary and tokenizer
    python benchmark/online/bench_serving.py --base-url http://127.0.0.1:8000 \
        --model path/to/Qwen3-0.6B --endpoint chat --request-rate 16 inf

    # CPU smoke run on the embedded model
    python benchmark/online/bench_serving.py --launch --offline --num-requests 8 --min-len 8 \
        --max-len 32 --request-rate 4 inf -- --device cpu --dtype float32
"""

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

# the offline benchmarks' common.py holds the standard workload and the table
sys.path.append(str(Path(__file__).resolve().parents[1] / "offline"))


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` above 0."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s (--base-url URL | --launch) [options] [-- server arguments]",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch",
        action="store_true",
        help="start our server (python -m minisgl with the arguments after --) and stop it after",
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="completions: token ids, or their text decoded with the model's tokenizer "
        "(chat always sends text)",
    )
    p.add_argument(
        "--model",
        help="local directory of the served model (its vocabulary and tokenizer make the "
        "prompts); with --launch also the server's --model (default: the embedded model)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model the requests name (default: the first of GET /v1/models); with --launch "
        "also the server's",
    )
    p.add_argument("--api-key", help="sent as a bearer token; with --launch also the server's")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "trace"], default="random")
    w.add_argument("--num-requests", type=positive(int), default=256)
    w.add_argument("--min-len", type=positive(int), default=100, help="shortest prompt and output")
    w.add_argument("--max-len", type=positive(int), default=1024, help="longest prompt and output")
    w.add_argument("--seed", type=int, default=0, help="prompt ids, lengths and arrivals")
    w.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's bench: 0.6")
    w.add_argument(
        "--prefix-len", type=positive(int), default=1024, help="shared-prefix: its length"
    )
    w.add_argument("--trace", help="trace: the JSONL file (workload.py gives its format)")
    w.add_argument(
        "--trace-block-size", type=positive(int), default=512, help="trace: tokens a hash id"
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=positive(float),
        nargs="+",
        help="requests/s offered, one run each, in increasing order, the arrivals spread as "
        "--burstiness says; inf: all at once (default: inf; a trace brings its own arrivals)",
    )
    load.add_argument(
        "--burstiness",
        type=positive(float),
        default=1.0,
        help="the arrivals' gamma shape, as vLLM's: 1 Poisson, below 1 burstier, above steadier, "
        "inf evenly spaced (default: 1)",
    )
    load.add_argument(
        "--max-concurrency",
        type=positive(int),
        help="requests in flight at most, over all client processes (default: any)",
    )
    load.add_argument(
        "--num-client-procs",
        type=positive(int),
        default=min(8, os.cpu_count() or 1),
        help="client processes (default: min(8, CPUs))",
    )
    load.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs a request must all meet to count in goodput: ttft, tpot, e2el in ms",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=32,
        help="the first N requests, with 16 output tokens, sent together before the runs (and "
        "generated before the offline run)",
    )

    s = p.add_argument_group("--launch")
    s.add_argument(
        "--offline",
        action="store_true",
        help="also run the requests through LLM.generate, with the server's engine settings, "
        "after the server has exited, and print online / offline output tok/s",
    )
    s.add_argument("--port", type=positive(int), help="default: a free port")
    s.add_argument("--server-timeout", type=positive(float), default=600, help="start-up, in s")
    s.add_argument("--server-log", help="the server's output (default: a file in the temp dir)")

    out = p.add_argument_group("output")
    out.add_argument("--result-json", help="every metric of every run, and the settings")
    out.add_argument("--plot", help="PNG of latency and throughput against the request rate")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the benchmark's options, the server's arguments: those after `--`)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args, server_argv = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if not args.launch and (server_argv or args.offline or args.port):
        parser.error("server arguments, --offline and --port go with --launch")
    if args.min_len > args.max_len:
        parser.error("--min-len is above --max-len")
    if (args.workload == "trace") != (args.trace is not None):
        parser.error("--workload trace and --trace PATH go together")
    if args.workload == "trace" and args.request_rate:
        parser.error("a trace brings its own arrivals: no --request-rate")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.workload != "trace":
        args.request_rate = args.request_rate or [float("inf")]
    return args, server_argv


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, server_argv = parse_args(sys.argv[1:] if argv is None else argv)
    # imported only here: the client processes re-import this script (multiprocessing's spawn)
    # and must start without torch, which the workload and the engine bring
    from runner import run

    try:
        return run(args, server_argv)
    # bad input (a model directory, a trace, an SLO), or a server or client that failed
    except (ValueError, RuntimeError, httpx.HTTPError) as e:
        sys.exit(f"bench_serving.py: error: {e}")


if __name__ == "__main__":
    main()
