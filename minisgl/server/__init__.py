"""Serving: the launcher, the OpenAI-compatible API server and the interactive shell."""

from .args import ServerArgs
from .cli import main, parse_args
from .launch import launch

__all__ = ["ServerArgs", "launch", "main", "parse_args"]
