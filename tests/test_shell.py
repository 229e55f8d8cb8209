"""`minisgl --shell`, driven through a pseudo-terminal: it answers, keeps the conversation, and
/reset forgets it. What the shell sent is read back from the server's prompt-token counter."""

import json
import os
import shutil
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pexpect
import pytest

from minisgl.server.shell import ReplyError, stream_reply
from minisgl.utils import DEFAULT_MODEL_PATH

from .server_process import children, free_port, process_name

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


def _spawn_shell(model: Path, port: int) -> pexpect.spawn:
    """`minisgl --shell` at its first prompt."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "minisgl", "--model", str(model), "--shell", "--port", str(port),
         "--max-kv-tokens", "4096"],
        env={**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"},  # the pty cannot answer cursor queries
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )  # fmt: skip
    child.expect_exact(PROMPT, timeout=START_TIMEOUT_S)
    return child


@pytest.fixture(scope="module")
def shell(chat_model: Path):
    port = free_port()
    child = _spawn_shell(chat_model, port)
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


def test_a_reply_whose_scheduler_dies_ends_with_an_error_and_the_next_line_exits(
    chat_model: Path,
) -> None:
    """The reply waits on a stopped scheduler, which is then killed: the reply ends with the
    server's error at once, and the shell, told at the next line, exits with the launcher's 1."""
    child = _spawn_shell(chat_model, free_port())
    try:
        (scheduler,) = [p for p in children(child.pid) if process_name(p) == "scheduler-0"]
        os.kill(scheduler, signal.SIGSTOP)
        child.sendline("hello")
        time.sleep(1)  # for the request to reach the API server (else it was shut, and says so)
        os.kill(scheduler, signal.SIGKILL)
        child.expect(r"error: (the engine stopped|the server is shutting down|no answer from)")
        child.expect_exact(PROMPT)
        child.sendline("hello again")
        child.expect(r"a process exited: scheduler-0 \(exit code -9\)\r?\n")
        child.expect(pexpect.EOF, timeout=30)
        child.close()
        assert child.exitstatus == 1
    finally:
        if child.isalive():
            child.terminate(force=True)
