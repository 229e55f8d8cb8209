"""`minisgl --shell`, driven through a pseudo-terminal: it answers, keeps the conversation, and
/reset forgets it. What the shell sent is read back from the server's prompt-token counter."""

import json
import os
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pexpect
import pytest

from minisgl.server.shell import ReplyError, stream_reply
from minisgl.utils import DEFAULT_MODEL_PATH

from .server_process import free_port

START_TIMEOUT_S = 180
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "you>"  # prompt_toolkit draws the trailing space separately


def _prompt_tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("minisgl_prompt_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no prompt token counter")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded stories model (fast, and it writes real words) given a chat template."""
    path = tmp_path_factory.mktemp("chat-stories") / "model"
    shutil.copytree(DEFAULT_MODEL_PATH, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def shell(chat_model: Path):
    port = free_port()
    model = str(chat_model)
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "minisgl",
            "--model",
            model,
            "--shell",
            "--port",
            str(port),
            "--max-kv-tokens",
            "4096",
        ],
        env={**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"},  # the pty cannot answer cursor queries
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT, timeout=START_TIMEOUT_S)
    yield child, f"http://127.0.0.1:{port}"
    if child.isalive():
        child.terminate(force=True)


def _chat(child: pexpect.spawn, line: str) -> str:
    """Type a line, wait for the whole reply and the next prompt; returns the reply."""
    child.sendline(line)
    child.expect(r"\[\d+ tokens in [\d.]+ s\]")
    reply = child.before.rsplit(line, 1)[-1]
    child.expect_exact(PROMPT)
    return reply


def test_shell_answers_keeps_the_history_and_reset_clears_it(shell) -> None:
    child, url = shell
    start = _prompt_tokens(url)
    assert _chat(child, "hello").strip()
    first = _prompt_tokens(url) - start

    _chat(child, "hello")
    second = _prompt_tokens(url) - start - first
    assert second > first + 2  # the first turn and its reply were sent again

    child.sendline("/reset")
    child.expect_exact("(history cleared)")
    child.expect_exact(PROMPT)
    _chat(child, "hello")
    assert _prompt_tokens(url) - start - first - second == first


def test_shell_exits_on_ctrl_d(shell) -> None:
    child, url = shell
    child.sendeof()
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    assert child.exitstatus == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health")


class _ErrorAfterOnePiece(BaseHTTPRequestHandler):
    """Streams one piece of a reply, then the error event a server sends when a request times
    out (a chunk without choices), then [DONE]."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        piece = {"choices": [{"index": 0, "delta": {"content": "Once"}}]}
        error = {"error": {"message": "past --request-timeout", "code": "request_timeout"}}
        for event in (piece, error):
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:  # quiet
        pass


def test_an_error_event_ends_the_reply_with_its_message() -> None:
    server = HTTPServer(("127.0.0.1", 0), _ErrorAfterOnePiece)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    chunks = []
    with pytest.raises(ReplyError, match="past --request-timeout"):
        for chunk in stream_reply(url, "m", None, [{"role": "user", "content": "hi"}]):
            chunks.append(chunk)
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["Once"]
    server.shutdown()
