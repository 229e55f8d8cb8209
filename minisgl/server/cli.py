"""`python -m minisgl` / `minisgl`: parse the command line and launch the server (or the shell).

Engine and scheduler options default to their config classes' defaults, so each default lives in
one place; only the options given on the command line are passed on.
"""

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.engine import EngineConfig
from minisgl.kvcache import PREFIX_CACHES
from minisgl.scheduler import SchedulerConfig
from minisgl.utils import DEFAULT_MODEL_PATH, resolve_model_path

from .args import ServerArgs
from .launch import launch

# option -> the config fields it sets; these options are passed on only when given
_CONFIG_OPTIONS: dict[str, list[tuple[type, str]]] = {
    "device": [(EngineConfig, "device")],
    "dtype": [(EngineConfig, "dtype")],
    "tp": [(EngineConfig, "tp_size")],
    "page_size": [(EngineConfig, "page_size")],
    "max_running_requests": [(EngineConfig, "max_running_requests")],
    "max_kv_tokens": [(EngineConfig, "max_kv_tokens")],
    "chunk_size": [(SchedulerConfig, "chunk_size")],
    "cache": [(SchedulerConfig, "cache")],
    "attention_backend": [(EngineConfig, "attention_backend")],
    "cuda_graph_max_bs": [(EngineConfig, "cuda_graph_max_bs")],
    "overlap": [(SchedulerConfig, "overlap")],
    "dummy_weights": [(EngineConfig, "dummy_weights")],
}


def _field_default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _given(ns: dict[str, Any], cls: type) -> dict[str, Any]:
    """The fields of `cls` that options on the command line set."""
    return {
        name: ns[option]
        for option, targets in _CONFIG_OPTIONS.items()
        for target, name in targets
        if target is cls and option in ns
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisgl",
        description="Serve a model with an OpenAI-compatible API (or chat with it: --shell).",
    )
    host, port = _field_default(ServerArgs, "host"), _field_default(ServerArgs, "port")

    def config_option(flag: str, help: str, **kwargs: Any) -> None:
        default = _field_default(*_CONFIG_OPTIONS[flag.removeprefix("--").replace("-", "_")][0])
        if default is not None:
            help = f"{help} (default: {default})"
        p.add_argument(flag, default=argparse.SUPPRESS, help=help, **kwargs)

    p.add_argument(
        "--model",
        help="local Hugging Face model directory; nothing is downloaded "
        f"(default: the embedded {DEFAULT_MODEL_PATH.name} model)",
    )
    p.add_argument("--host", default=host, help=f"address to listen on (default: {host})")
    p.add_argument("--port", type=int, default=port, help=f"port to listen on (default: {port})")
    config_option("--device", "cpu, cuda, or auto: cuda when available")
    config_option("--dtype", "float32, bfloat16, float16, or auto: bfloat16 on cuda, else float32")
    config_option("--tp", "tensor-parallel size: one scheduler process per rank", type=int)
    config_option("--page-size", "tokens per KV cache page", type=int)
    config_option(
        "--max-running-requests", "requests decoded together at most (KV slots)", type=int
    )
    config_option(
        "--max-kv-tokens", "KV cache size in tokens (default: sized from free memory)", type=int
    )
    config_option(
        "--chunk-size",
        "tokens per step, decodes first; longer prompts are prefilled in chunks",
        type=int,
    )
    config_option("--cache", "prefix cache policy", choices=PREFIX_CACHES.names())
    config_option(
        "--attention-backend", "attention kernels", choices=["auto", *ATTENTION_BACKENDS.names()]
    )
    config_option(
        "--cuda-graph-max-bs",
        "largest decode batch replayed from a CUDA graph; 0 turns graphs off "
        "(default: --max-running-requests on cuda)",
        type=int,
    )
    config_option(
        "--overlap",
        "build step k+1 on the CPU while the GPU runs step k (--no-overlap: one after the other)",
        action=argparse.BooleanOptionalAction,
    )
    config_option(
        "--dummy-weights",
        "random weights in the checkpoint's shape (a directory with only config.json and the "
        "tokenizer is enough): for speed measurements",
        action="store_true",
    )
    p.add_argument(
        "--api-key",
        help="clients must send `Authorization: Bearer <key>` to /v1 routes (default: none)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: --model as given)",
    )
    p.add_argument(
        "--shell",
        action="store_true",
        help="chat with the model in this terminal: /reset clears the history, /exit quits",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    ns = vars(build_parser().parse_args(argv))
    path = resolve_model_path(ns["model"])
    return ServerArgs(
        engine=EngineConfig(model_path=path, **_given(ns, EngineConfig)),
        scheduler=SchedulerConfig(**_given(ns, SchedulerConfig)),
        served_model_name=ns["served_model_name"] or ns["model"] or path.name,
        host=ns["host"],
        port=ns["port"],
        api_key=ns["api_key"],
        shell=ns["shell"],
    )


def main(argv: Sequence[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except ValueError as e:
        sys.exit(f"minisgl: error: {e}")
    sys.exit(launch(args))
