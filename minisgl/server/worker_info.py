"""GET /model_info and /server_info in SGLang's shapes: what sglang-router reads from each worker it
is given (--dp) before it routes to it. It names the worker's model by `served_model_name` and
loads its own tokenizer from `model_path`."""

import dataclasses
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from .args import ServerArgs


def model_info(args: ServerArgs) -> dict[str, Any]:
    path = args.engine.model_path
    config = json.loads((path / "config.json").read_text())
    return {
        "model_path": str(path),
        "tokenizer_path": str(path),  # the tokenizer process loads it from the model directory
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def server_info(args: ServerArgs) -> dict[str, Any]:
    """Every setting, flat as SGLang's server args are (the API key left out), and the version."""
    settings = dataclasses.asdict(args)
    for part in ("engine", "scheduler", "limits"):
        settings.update(settings.pop(part))
    del settings["api_key"]
    info = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    return {**info, "version": importlib.metadata.version("minisgl")}
