"""`minisgl [serve] [MODEL]` / `python -m minisgl`: parse the command line, check the settings, and
launch the server (or the shell).

Most options are fields of the settings classes, typed and defaulted there, so each default lives
in one place; only the options given on the command line are passed on. Nothing here imports torch:
`minisgl --help` answers at once.
"""

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.config import EngineConfig, SchedulerConfig
from minisgl.kvcache import PREFIX_CACHES
from minisgl.moe import MOE_BACKENDS
from minisgl.utils import DEFAULT_MODEL_PATH, resolve_model_path

from .args import ROUTER_POLICIES, ServerArgs
from .launch import launch
from .limits import RequestLimits
from .reasoning import REASONING_PARSERS
from .tool_parser import TOOL_PARSERS

API_KEY_ENV = "MINISGL_API_KEY"

# The options that set a field, with their help: the field of its name (--tp: tp_size) in the one
# of _TARGETS that has it.
_TARGETS = (EngineConfig, SchedulerConfig, RequestLimits, ServerArgs)
_FIELD_NAMES = {"tp": "tp_size", "dp": "dp_size"}
_CHOICES = {
    "cache": PREFIX_CACHES.choices(),
    "attention_backend": ATTENTION_BACKENDS.choices(),
    "moe_backend": MOE_BACKENDS.choices(),
    "log_level": ["debug", "info", "warning", "error"],
    "tool_call_parser": sorted(TOOL_PARSERS),
    "reasoning_parser": sorted(REASONING_PARSERS),
    "router_policy": list(ROUTER_POLICIES),
}
_HELP = {
    "host": "address to listen on",
    "port": "port to listen on (1-65535)",
    "device": "cpu, cuda, or auto: cuda when available",
    "dtype": "float32, bfloat16, float16, or auto: bfloat16 on cuda, else float32",
    "tp": "tensor-parallel size: one scheduler process per rank",
    "nnodes": "machines the TP ranks are spread over, each running this command with its "
    "--node-rank",
    "node_rank": "this machine's place among --nnodes: node 0 serves the API, the others only "
    "their scheduler ranks",
    "dist_init_addr": "HOST:PORT of node 0 where the ranks meet (torch.distributed over TCP; "
    "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME pick the network interface)",
    "dp": "data-parallel replicas, each a whole server on a port, GPUs and CPU cores of its own, "
    "behind vllm-router on --host/--port (pip install 'minisgl[router]')",
    "router_policy": "how vllm-router picks a replica for a request (with --dp); cache_aware: "
    "the one that served the longest prefix of its prompt, unless the loads are far apart",
    "page_size": "tokens per KV cache page",
    "max_running_requests": "requests decoded together at most (KV slots)",
    "max_kv_tokens": "KV cache size in tokens (default: sized from free memory)",
    "max_model_len": "prompt + output tokens of one request at most; the KV cache must hold one "
    "such request (default: the model's context)",
    "gpu_memory_utilization": "share of the device memory free at start-up for the weights and "
    "the KV cache (default: 0.85 on a GPU; on the CPU, the KV cache takes 20%% of it)",
    "chunk_size": "tokens per step, decodes first; longer prompts in chunks",
    "cache": "prefix cache policy",
    "attention_backend": "attention kernels",
    "moe_backend": "mixture-of-experts kernels (for a model with experts)",
    "cuda_graph_max_bs": "largest decode batch replayed from a CUDA graph; 0 turns graphs off "
    "(default: --max-running-requests on cuda)",
    "overlap": "build step k+1 on the CPU while the GPU runs step k (--no-overlap: one after the "
    "other)",
    "dummy_weights": "random weights in the checkpoint's shape (a directory with only config.json "
    "and the tokenizer is enough): for speed measurements",
    "seed": "draws the sampling seed of requests that give none",
    "grammar_timeout": "seconds a structured output's grammar may take to compile (its wait for "
    "a grammar thread included); past it the request is a 400",
    "max_n": "choices per request at most (OpenAI's limit)",
    "max_prompts": "prompts per completions request at most (OpenAI's)",
    "max_request_bytes": "request body size at most; larger is a 413",
    "max_header_bytes": "request line, headers and trailers size at most; larger is a 431",
    "max_stop_strings": "stop strings per request at most",
    "max_stop_length": "characters per stop string at most",
    "max_stop_token_ids": "stop_token_ids per request at most",
    "max_logit_bias": "tokens a request's logit_bias biases at most",
    "max_params_bytes": "bytes of sampling parameters a request's choices (prompts x n, each "
    "with its own copy) carry to the engine at most",
    "max_prompt_logprobs": "prompt logprobs a request's answer may hold at most: its prompts' "
    "tokens after the first, each with its own and its prompt_logprobs (or echo's logprobs) "
    "likeliest, in each choice of a completion (chat gives them once)",
    "max_queued_requests": "requests waiting for their first token at most; more get a 429 "
    "(default: no limit)",
    "request_timeout": "seconds a request may run before it is stopped with a 400 whose code is "
    "request_timeout (default: no limit)",
    "shutdown_timeout": "seconds running requests may finish after SIGTERM before they are "
    "answered with 503",
    "health_timeout": "/health answers 503 once the engine has sent no heartbeat for this many "
    "seconds",
    "timeout_keep_alive": "seconds an HTTP connection may stay idle: between requests, "
    "mid-request, or with its response unread (with --dp, the replicas'; vllm-router has no "
    "such limit)",
    "log_level": "logging level",
    "enable_log_requests": "log a line for each request as it ends: its id (X-Request-Id), "
    "route, status, tokens and seconds (as vLLM's)",
    "tool_call_parser": "read tool calls out of chat replies in this model family's format, for "
    "tool_choice auto (required and named choices need none: a grammar holds the reply to the "
    "calls)",
    "reasoning_parser": "split chat replies into reasoning_content (the model's thinking) and "
    "content",
    "structured_outputs_in_reasoning": "with --reasoning-parser, hold a chat reply to its "
    "structured output (response_format, a required or named tool_choice, ...) from its first "
    "token, thinking included (default: from the end of the thinking, as vLLM)",
    "generation_config": "the sampling defaults (temperature, top_p, top_k, min_p, "
    "repetition_penalty) of requests that leave them out, as in vLLM: auto, the model's "
    "generation_config.json; vllm, none; or a folder holding a generation_config.json",
    "shell": "chat with the model in this terminal: /reset clears the history, /exit quits",
}


def _fields() -> dict[str, tuple[type, dataclasses.Field[Any]]]:
    """option -> (the class it sets a field of, that field), for every option in _HELP."""
    by_name = {f.name: (cls, f) for cls in _TARGETS for f in dataclasses.fields(cls)}
    return {option: by_name[_FIELD_NAMES.get(option, option)] for option in _HELP}


def _given(ns: dict[str, Any], cls: type) -> dict[str, Any]:
    """The fields of `cls` that options on the command line set."""
    return {
        field.name: ns[option]
        for option, (target, field) in _fields().items()
        if target is cls and option in ns
    }


def _add_field_option(
    p: argparse.ArgumentParser, option: str, field: dataclasses.Field[Any]
) -> None:
    """--option, typed as the field (a bool one a switch) and passed on only when given."""
    help, default = _HELP[option], field.default
    if field.type is bool:  # a switch: --X turns on what is off by default, --no-X turns it off
        kwargs = {"action": argparse.BooleanOptionalAction if default else "store_true"}
    else:  # X or X | None
        kind = next(t for t in get_args(field.type) or [field.type] if t is not type(None))
        kwargs = {"type": kind, "choices": _CHOICES.get(option)}
    if default is not None and kwargs.get("action") != "store_true":
        help = f"{help} (default: {default})"
    flag = "--" + option.replace("_", "-")
    p.add_argument(flag, default=argparse.SUPPRESS, help=help, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisgl",
        description="Serve a model with an OpenAI-compatible API (or chat with it: --shell). "
        "`minisgl serve MODEL` works too.",
    )
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
    for option, (_, field) in _fields().items():
        _add_field_option(p, option, field)
    p.add_argument(
        "--api-key",
        help="clients must send `Authorization: Bearer <key>` (every route but /health and "
        f"/metrics); also read from ${API_KEY_ENV}, which `ps` does not show (default: none)",
    )
    p.add_argument(
        "--allowed-origins",
        help="the origins whose browser pages may call the API (CORS), as vLLM's: a JSON list "
        '(default: ["*"], any)',
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model name clients send and /v1/models lists (default: --model as given); "
        "several: clients may send any, replies name the first (as vLLM's)",
    )
    p.add_argument(
        "--chat-template", help="a Jinja chat template, or a file holding one, used instead of "
        "the model's",
    )  # fmt: skip
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
    if "router_policy" in ns and ns.get("dp", 1) == 1:  # its default cannot tell given from not
        raise ValueError("--router-policy picks among --dp replicas: give --dp N (N > 1) too")
    if ns["model_path"] and ns["model"] and ns["model_path"] != ns["model"]:
        raise ValueError("give the model once: as MODEL or as --model")
    model = ns["model_path"] or ns["model"]
    if model is None and len(ns["served_model_name"] or ()) > 1:
        # `--served-model-name NAME MODEL` reads the model as a second name: say so, not serve
        # the default model under two names
        raise ValueError(
            "--served-model-name takes several names: give the model before it (minisgl MODEL "
            "--served-model-name NAME) or as --model"
        )
    path = resolve_model_path(model)
    chat_template = ns["chat_template"]
    # as vLLM reads it: a file where one opens (its path may hold `{`), else the template's
    # text; text with none of Jinja's characters names a file, which must open
    if chat_template is not None:
        try:
            chat_template = Path(chat_template).read_text()
        except (OSError, ValueError) as e:  # ValueError: a NUL in the text
            if not any(c in chat_template for c in "{}\n"):
                raise ValueError(
                    f"--chat-template {chat_template!r} is no readable file: {e}"
                ) from None
    origins = {}
    if ns["allowed_origins"] is not None:
        origins["allowed_origins"] = _origins(ns["allowed_origins"])
    names = ns["served_model_name"] or [model or path.name]
    return ServerArgs(
        engine=EngineConfig(model_path=path, **_given(ns, EngineConfig)),
        scheduler=SchedulerConfig(**_given(ns, SchedulerConfig)),
        served_model_name=names[0],
        served_model_aliases=tuple(names[1:]),
        api_key=ns["api_key"] or environ.get(API_KEY_ENV) or None,  # empty: no key, as vLLM
        chat_template=chat_template,
        limits=RequestLimits(**_given(ns, RequestLimits)),
        **origins,
        **_given(ns, ServerArgs),
    )


def _origins(text: str) -> tuple[str, ...]:
    try:
        origins = json.loads(text)
    except ValueError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise ValueError(f'--allowed-origins must be a JSON list of strings (["*"]), not {text!r}')
    return tuple(origins)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        args = parse_args(argv)
        # imported here, after --help has answered: the checks need torch
        from .preflight import check_settings

        check_settings(args)
    except ValueError as e:
        sys.exit(f"minisgl: error: {_in_flags(str(e))}")
    sys.exit(launch(args))


def _in_flags(message: str) -> str:
    """A settings error in the command line's words: each field it names (max_model_len, which
    the offline LLM takes) as its option (--max-model-len); one-word names (device) are words."""
    for option, (_, field) in _fields().items():
        if "_" in field.name:
            flag = "--" + option.replace("_", "-")
            # not inside a file name: generation_config.json stays
            message = re.sub(rf"(?<![\w-]){field.name}\b(?!\.\w)", flag, message)
    return message
