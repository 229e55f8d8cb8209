"""Settings checked in the launcher before any child process starts, so that a bad one fails in
one line instead of in a child after start-up. What only the engine can know (whether the KV
cache fits in the memory left after the weights) fails in the scheduler process, in one line too."""

import importlib.util
import socket

import torch

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.config import check_kv_capacity, kv_pages, max_seq_len
from minisgl.kvcache import PREFIX_CACHES
from minisgl.models.config import ModelConfig
from minisgl.moe import MOE_BACKENDS
from minisgl.tokenizer.loader import check_chat_template, check_tokenizer, load_tokenizer
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import resolve_device, resolve_dtype

from .args import ServerArgs


def check_settings(args: ServerArgs) -> None:
    """Raise ValueError, with a message for the operator, unless the server can start."""
    engine = args.engine
    if engine.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {engine.device}: no CUDA device is available")
    device = resolve_device(engine.device)
    resolve_dtype(engine.dtype, device)
    if args.dp_size > 1:
        _check_data_parallel(args)
    gpus = engine.ranks_per_node * args.dp_size
    if device.type == "cuda" and gpus > torch.cuda.device_count():
        flags = f"--tp {engine.tp_size}" + (f" --dp {args.dp_size}" if args.dp_size > 1 else "")
        where = f" on each of {engine.nnodes} nodes" if engine.nnodes > 1 else ""
        raise ValueError(f"{flags} needs {gpus} GPU(s){where}; {torch.cuda.device_count()} found")
    ATTENTION_BACKENDS.resolve(engine.attention_backend, device.type)
    MOE_BACKENDS.resolve(engine.moe_backend, device.type)
    PREFIX_CACHES.resolve(args.scheduler.cache, device.type)
    _check_model(args)
    if args.node_rank == 0:  # the others serve no API
        _check_port_free(args.host, args.port)


def _check_data_parallel(args: ServerArgs) -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("--dp needs sglang-router: pip install 'minisgl[router]'")
    if ":" in args.engine.device:
        raise ValueError("--dp gives each replica GPUs of its own: --device cuda, not one GPU")
    if args.engine.nnodes > 1:
        raise ValueError("--dp runs its replicas on this machine: not with --nnodes")


def _check_model(args: ServerArgs) -> None:
    engine = args.engine
    path = engine.model_path
    if not engine.dummy_weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} holds no *.safetensors weights (--dummy-weights for random ones)")
    check_tokenizer(path)
    if args.chat_template is not None:
        check_chat_template(load_tokenizer(path), args.chat_template)
    try:
        config = ModelConfig.from_hf(cached_load_hf_config(path))
    except (OSError, KeyError) as e:
        raise ValueError(f"{path}/config.json cannot be read: {e}") from None
    config.check_tp(engine.tp_size)
    seq_len = max_seq_len(engine, config.max_position_embeddings)
    if engine.max_kv_tokens is not None:
        pages = kv_pages(engine.max_kv_tokens, engine.page_size)
        check_kv_capacity(pages, engine.page_size, seq_len)


def _check_port_free(host: str, port: int) -> None:
    """Fail before starting anything, rather than mistake another server's /health for ours."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
