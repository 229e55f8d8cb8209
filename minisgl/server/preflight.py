"""Settings checked in the launcher before any child process starts, so that a bad one fails in
one line instead of in a child after start-up: the engine's (`engine.preflight`, which the
offline LLM runs too), then the server's own."""

import importlib.util
import socket

import torch

from minisgl.engine.preflight import check_engine_config
from minisgl.kvcache import PREFIX_CACHES
from minisgl.tokenizer.loader import check_chat_template, check_tokenizer, load_tokenizer
from minisgl.utils import sampling_defaults
from minisgl.utils.torch_utils import resolve_device

from .args import ServerArgs


def check_settings(args: ServerArgs) -> None:
    """Raise ValueError, with a message for the operator, unless the server can start."""
    engine = args.engine
    if args.dp_size > 1:
        _check_data_parallel(args)
    check_engine_config(engine)
    device = resolve_device(engine.device)
    gpus = engine.ranks_per_node * args.dp_size
    if device.type == "cuda" and gpus > torch.cuda.device_count():
        flags = f"--tp {engine.tp_size}" + (f" --dp {args.dp_size}" if args.dp_size > 1 else "")
        where = f" on each of {engine.nnodes} nodes" if engine.nnodes > 1 else ""
        raise ValueError(f"{flags} needs {gpus} GPU(s){where}; {torch.cuda.device_count()} found")
    PREFIX_CACHES.resolve(args.scheduler.cache, device.type)
    check_tokenizer(engine.model_path)
    sampling_defaults(args.generation_config, engine.model_path)
    if args.chat_template is not None:
        check_chat_template(load_tokenizer(engine.model_path), args.chat_template)
    if args.node_rank == 0:  # the others serve no API
        _check_port_free(args.host, args.port)


def _check_data_parallel(args: ServerArgs) -> None:
    if importlib.util.find_spec("vllm_router") is None:
        raise ValueError("--dp needs vllm-router: pip install 'minisgl[router]'")
    if ":" in args.engine.device:
        raise ValueError("--dp gives each replica GPUs of its own: --device cuda, not one GPU")
    if args.engine.nnodes > 1:
        raise ValueError("--dp runs its replicas on this machine: not with --nnodes")


def _check_port_free(host: str, port: int) -> None:
    """Fail before starting anything, rather than mistake another server's /health for ours."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
