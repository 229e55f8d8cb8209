"""`minisgl [serve] [MODEL]` / `python -m minisgl`: parse the command line, check the settings, and
launch the server (or the shell).

Engine and scheduler options default to their config classes' defaults, so each default lives in
one place; only the options given on the command line are passed on. Nothing here imports torch:
`minisgl --help` answers at once.
"""

import argparse
import dataclasses
import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.config import EngineConfig, SchedulerConfig
from minisgl.kvcache import PREFIX_CACHES
from minisgl.utils import DEFAULT_MODEL_PATH, resolve_model_path

from .args import ServerArgs
from .launch import launch
from .limits import RequestLimits
from .reasoning import REASONING_PARSERS
from .tool_parser import TOOL_PARSERS

API_KEY_ENV = "MINISGL_API_KEY"

# option -> (config class, field); these options are passed on only when given
_CONFIG_OPTIONS: dict[str, tuple[type, str]] = {
    "device": (EngineConfig, "device"),
    "dtype": (EngineConfig, "dtype"),
    "tp": (EngineConfig, "tp_size"),
    "page_size": (EngineConfig, "page_size"),
    "max_running_requests": (EngineConfig, "max_running_requests"),
    "max_kv_tokens": (EngineConfig, "max_kv_tokens"),
    "max_model_len": (EngineConfig, "max_model_len"),
    "gpu_memory_utilization": (EngineConfig, "gpu_memory_utilization"),
    "attention_backend": (EngineConfig, "attention_backend"),
    "cuda_graph_max_bs": (EngineConfig, "cuda_graph_max_bs"),
    "dummy_weights": (EngineConfig, "dummy_weights"),
    "chunk_size": (SchedulerConfig, "chunk_size"),
    "cache": (SchedulerConfig, "cache"),
    "overlap": (SchedulerConfig, "overlap"),
    "seed": (SchedulerConfig, "seed"),
    "max_n": (RequestLimits, "max_n"),
    "max_prompts": (RequestLimits, "max_prompts"),
    "max_request_bytes": (RequestLimits, "max_request_bytes"),
    "max_stop_strings": (RequestLimits, "max_stop_strings"),
    "max_stop_length": (RequestLimits, "max_stop_length"),
    "max_queued_requests": (RequestLimits, "max_queued_requests"),
    "request_timeout": (ServerArgs, "request_timeout"),
    "shutdown_timeout": (ServerArgs, "shutdown_timeout"),
    "health_timeout": (ServerArgs, "health_timeout"),
    "timeout_keep_alive": (ServerArgs, "timeout_keep_alive"),
    "log_level": (ServerArgs, "log_level"),
    "tool_call_parser": (ServerArgs, "tool_call_parser"),
    "reasoning_parser": (ServerArgs, "reasoning_parser"),
    "host": (ServerArgs, "host"),
    "port": (ServerArgs, "port"),
}


def _field_default(cls: type, name: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _given(ns: dict[str, Any], cls: type) -> dict[str, Any]:
    """The fields of `cls` that options on the command line set."""
    return {
        name: ns[option]
        for option, (target, name) in _CONFIG_OPTIONS.items()
        if target is cls and option in ns
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisgl",
        description="Serve a model with an OpenAI-compatible API (or chat with it: --shell). "
        "`minisgl serve MODEL` works too.",
    )

    def option(flag: str, help: str, **kwargs: Any) -> None:
        default = _field_default(*_CONFIG_OPTIONS[flag.removeprefix("--").replace("-", "_")])
        if default is not None and kwargs.get("action") != "store_true":
            help = f"{help} (default: {default})"
        p.add_argument(flag, default=argparse.SUPPRESS, help=help, **kwargs)

    version = importlib.metadata.version("minisgl")
    p.add_argument("--version", action="version", version=f"minisgl {version}")
    p.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="local Hugging Face model directory, as --model",
    )
    p.add_argument(
        "--model",
        help="local Hugging Face model directory; nothing is downloaded "
        f"(default: the embedded {DEFAULT_MODEL_PATH.name} model)",
    )
    option("--host", "address to listen on")
    option("--port", "port to listen on (1-65535)", type=int)
    option("--device", "cpu, cuda, or auto: cuda when available")
    option("--dtype", "float32, bfloat16, float16, or auto: bfloat16 on cuda, else float32")
    option("--tp", "tensor-parallel size: one scheduler process per rank", type=int)
    option("--page-size", "tokens per KV cache page", type=int)
    option("--max-running-requests", "requests decoded together at most (KV slots)", type=int)
    option("--max-kv-tokens", "KV cache size in tokens (default: sized from free memory)", type=int)
    option(
        "--max-model-len",
        "prompt + output tokens of one request at most; the KV cache must hold one such request "
        "(default: the model's context)",
        type=int,
    )
    option(
        "--gpu-memory-utilization",
        "share of the GPU memory free at start-up for the weights and the KV cache",
        type=float,
    )
    option("--chunk-size", "tokens per step, decodes first; longer prompts in chunks", type=int)
    option("--cache", "prefix cache policy", choices=PREFIX_CACHES.choices())
    option("--attention-backend", "attention kernels", choices=ATTENTION_BACKENDS.choices())
    option(
        "--cuda-graph-max-bs",
        "largest decode batch replayed from a CUDA graph; 0 turns graphs off "
        "(default: --max-running-requests on cuda)",
        type=int,
    )
    option(
        "--overlap",
        "build step k+1 on the CPU while the GPU runs step k (--no-overlap: one after the other)",
        action=argparse.BooleanOptionalAction,
    )
    option(
        "--dummy-weights",
        "random weights in the checkpoint's shape (a directory with only config.json and the "
        "tokenizer is enough): for speed measurements",
        action="store_true",
    )
    option("--seed", "draws the sampling seed of requests that give none", type=int)
    p.add_argument(
        "--api-key",
        help="clients must send `Authorization: Bearer <key>` (every route but /health and "
        f"/metrics); also read from ${API_KEY_ENV}, which `ps` does not show (default: none)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: --model as given)",
    )
    p.add_argument(
        "--chat-template", help="a Jinja chat template, or a file holding one, used instead of "
        "the model's",
    )  # fmt: skip
    option(
        "--tool-call-parser",
        "read tool calls out of chat replies in this model family's format, for tool_choice "
        "auto (required and named choices need none: a grammar holds the reply to the calls)",
        choices=sorted(TOOL_PARSERS),
    )
    option(
        "--reasoning-parser",
        "split chat replies into reasoning_content (the model's thinking) and content",
        choices=sorted(REASONING_PARSERS),
    )
    option("--max-n", "choices per request at most (OpenAI's limit)", type=int)
    option("--max-prompts", "prompts per completions request at most (OpenAI's)", type=int)
    option("--max-request-bytes", "request body size at most; larger is a 413", type=int)
    option("--max-stop-strings", "stop strings per request at most", type=int)
    option("--max-stop-length", "characters per stop string at most", type=int)
    option(
        "--max-queued-requests",
        "requests waiting for their first token at most; more get a 429 (default: no limit)",
        type=int,
    )
    option(
        "--request-timeout",
        "seconds a request may run before it is stopped with a 408 (default: no limit)",
        type=float,
    )
    option(
        "--shutdown-timeout",
        "seconds running requests may finish after SIGTERM before they are answered with 503",
        type=float,
    )
    option(
        "--health-timeout",
        "/health answers 503 once the engine has sent no heartbeat for this many seconds",
        type=float,
    )
    option("--timeout-keep-alive", "seconds an idle HTTP connection stays open", type=int)
    option("--log-level", "logging level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--shell",
        action="store_true",
        help="chat with the model in this terminal: /reset clears the history, /exit quits",
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
) -> ServerArgs:
    """The server's settings from the command line (and the API key from the environment);
    raises ValueError for a bad value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `minisgl serve MODEL`, as `vllm serve`
        argv = argv[1:]
    ns = vars(build_parser().parse_args(argv))
    if ns["model_path"] and ns["model"] and ns["model_path"] != ns["model"]:
        raise ValueError("give the model once: as MODEL or as --model")
    model = ns["model_path"] or ns["model"]
    path = resolve_model_path(model)
    chat_template = ns["chat_template"]
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    return ServerArgs(
        engine=EngineConfig(model_path=path, **_given(ns, EngineConfig)),
        scheduler=SchedulerConfig(**_given(ns, SchedulerConfig)),
        served_model_name=ns["served_model_name"] or model or path.name,
        api_key=ns["api_key"] or environ.get(API_KEY_ENV),
        shell=ns["shell"],
        chat_template=chat_template,
        limits=RequestLimits(**_given(ns, RequestLimits)),
        **_given(ns, ServerArgs),
    )


def main(argv: Sequence[str] | None = None) -> None:
    try:
        args = parse_args(argv)
        # imported here, after --help has answered: the checks need torch
        from .preflight import check_settings

        check_settings(args)
    except ValueError as e:
        sys.exit(f"minisgl: error: {e}")
    sys.exit(launch(args))
