"""`minisgl --shell`: chat with the served model in the terminal, through its own HTTP API.

The shell keeps the conversation and sends all of it each turn, streaming the reply as it comes.
/reset forgets the conversation; /exit or Ctrl-D leaves; Ctrl-C stops a reply early. Once a
server process has exited, the next line typed ends the shell (and the launcher exits 1).
"""

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import WordCompleter

from .direct_http import open_direct

# a reply cap keeps room in the context for the conversation (the API's default is the whole rest)
REPLY_MAX_TOKENS = 256
_COMMANDS = ("/reset", "/exit")


def stream_reply(
    url: str, model: str, api_key: str | None, messages: list[dict[str, str]]
) -> Iterator[dict[str, Any]]:
    """The reply's chunks, as the server streams them; the last one has the usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": REPLY_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), headers
    )
    with open_direct(request, timeout=None) as response:
        for line in response:
            data = line.decode().removeprefix("data: ").strip()
            if data and data != "[DONE]":
                chunk = json.loads(data)
                if "error" in chunk:  # the server's error event, after the reply began
                    raise ReplyError(chunk["error"]["message"])
                yield chunk


class ReplyError(Exception):
    """The server ended a reply with an error (a timeout, a shutdown)."""


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read())["error"]["message"]
    except (ValueError, KeyError):
        return str(e)


def run_shell(url: str, model: str, api_key: str | None, exited: Callable[[], list[str]]) -> None:
    """The REPL; returns on /exit or Ctrl-D, and raises RuntimeError at the next line typed
    once `exited()` names a server process that has exited."""
    session: PromptSession[str] = PromptSession(completer=WordCompleter(list(_COMMANDS)))
    history: list[dict[str, str]] = []
    print(
        f"minisgl shell: chatting with {model}. /reset clears the history, /exit or Ctrl-D quits."
    )
    while True:
        try:
            line = session.prompt("you> ").strip()
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        if line == "/exit":
            return
        if line == "/reset":
            history.clear()
            print("(history cleared)")
            continue
        if not line:
            continue
        if dead := exited():
            raise RuntimeError(f"a process exited: {', '.join(dead)}")
        turn = [*history, {"role": "user", "content": line}]
        reply, start = "", time.monotonic()
        try:
            for chunk in stream_reply(url, model, api_key, turn):
                for choice in chunk["choices"]:
                    piece = choice["delta"].get("content") or ""
                    reply += piece
                    print(piece, end="", flush=True)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    print(f"\n[{tokens} tokens in {time.monotonic() - start:.1f} s]")
        except KeyboardInterrupt:
            print("\n(reply stopped)")
            continue
        except urllib.error.HTTPError as e:
            print(f"error: {_error_message(e)} (/reset starts a new conversation)")
            continue
        except ReplyError as e:
            print(f"\nerror: {e} (/reset starts a new conversation)")
            continue
        except (OSError, http.client.HTTPException) as e:  # the API server is gone
            print(f"\nerror: no answer from the server ({e})")
            continue
        history = [*turn, {"role": "assistant", "content": reply}]
