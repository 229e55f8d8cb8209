"""The launcher as a new user meets it: a bad setting fails before any child starts, in one line and
no traceback; a setting only the engine can check fails in one line naming the process; and the
flags vLLM users reach for exist and reach the server."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl.server.cli import main, parse_args
from minisgl.server.launch import _base_url, _start_into, _Stop
from minisgl.utils import DEFAULT_MODEL_PATH
from minisgl.utils.process import start_child
from minisgl.utils.torch_utils import resolve_dtype

from .conftest import TOKENIZER_FILES
from .server_process import ServerProcess, alive, free_port, process_name, spawned_children


def _launch(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "minisgl", "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _model_dir(
    tmp_path: Path, weights: bool = True, tokenizer: bool = True, drop: str | None = None, **config
) -> Path:
    """A copy of the embedded model, without some of its files or one tensor (`drop`), or with
    config fields changed."""
    path = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_PATH, path)
    if not weights:
        (path / "model.safetensors").unlink()
    if drop is not None:
        tensors = load_file(path / "model.safetensors")
        del tensors[drop]
        save_file(tensors, path / "model.safetensors")
    if not tokenizer:
        for name in TOKENIZER_FILES:
            (path / name).unlink(missing_ok=True)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **config}))
    return path


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cuda"], "no CUDA device"),
        (["--device", "cpu", "--dtype", "float8"], "unknown dtype"),
        (["--device", "cpu", "--attention-backend", "triton"], "does not run on cpu"),
        (["--device", "cpu", "--port", "99999"], "--port must be in 1-65535"),
        (["--device", "cpu", "--port", "0"], "--port must be in 1-65535"),
        (["--device", "cpu", "--dp", "0"], "--dp must be >= 1"),
        (["--device", "cpu", "--max-kv-tokens", "256"], "set --max-model-len to at most 256"),
        (["--device", "cpu", "--max-model-len", "4096"], "exceeds the model's 2048 positions"),
        (["--device", "cpu", "--model", "/nonexistent"], "not a model directory"),
        (["--tp", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--device", "cpu", "--shutdown-timeout", "inf"], "--shutdown-timeout must be a finite"),
        (["--device", "cpu", "--request-timeout", "nan"], "--request-timeout must be a finite"),
        (["--device", "cpu", "--shutdown-timeout", "3e6"], "and at most 1,000,000, not 3000000"),
        (  # it failed in the scheduler, once the weights and the KV cache were built
            ["--device", "cpu", "--max-running-requests", "100000000"],
            "int32 entries: lower --max-running-requests or --max-model-len",
        ),
        # the offline LLM's field names were the messages' words
        (["--device", "cpu", "--max-model-len", "0"], "--max-model-len must be an integer >= 1"),
        (["--device", "cpu", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be"),
        (["--device", "cpu", "--tp", "0"], "--tp must be an integer >= 1"),
        # every request was refused with a 400, and nothing said so at start
        (["--device", "cpu", "--max-params-bytes", "100"], "--max-params-bytes must be at least"),
        (["--device", "cpu", "--grammar-timeout", "0"], "--grammar-timeout must be a number of"),
        (["--device", "cpu", "--grammar-timeout", "nan"], "--grammar-timeout must be a number of"),
        (["--device", "cpu", "--health-timeout", "0.3"], "--health-timeout must be at least 1 s"),
        (["--device", "cpu", "--chat-template", "/nonexistent/t.jinja"], "no readable file"),
        (["--device", "cpu", "--chat-template", "{% if %}"], "--chat-template is no Jinja"),
        # an empty file was served, and every chat got a 400
        (["--device", "cpu", "--chat-template", " \n"], "--chat-template writes no text"),
        (["--device", "cpu", "--tp", "3"], "--tp 3 must divide the model's attention heads (8)"),
        # a traceback before; cpu:3 failed in scheduler-0 after the API server started
        (["--device", "tpu"], "device 'tpu' is not supported"),
        (["--device", "cpu:3"], "device 'cpu:3' is not supported"),
        (["--device", "mps"], "device 'mps' is not supported"),  # "unknown attention backend"
        (["--device", "cpu", "--host", ""], "--host must name an address"),  # waited for good
        (["--device", "cpu", "--served-model-name", ""], "--served-model-name must not be empty"),
        # the model path after the flag was a second name, and the default model was served
        (
            ["--device", "cpu", "--served-model-name", "a", str(DEFAULT_MODEL_PATH)],
            "give the model before it",
        ),
    ],
)
def test_a_bad_setting_fails_before_any_child_starts_in_one_line(flags, message) -> None:
    if "cuda" in flags and _cuda_available():
        pytest.skip("this machine has a GPU")
    run = _launch(*flags)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minisgl: error:"), run.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0-1, not 2"),
        (["--tp", "3", "--nnodes", "2"], "a TP size of 3 does not split over 2 nodes"),
        (["--dist-init-addr", "29500"], "--dist-init-addr must be HOST:PORT, not '29500'"),
    ],
)
def test_a_bad_node_layout_is_refused_with_the_settings(flags: list[str], message: str) -> None:
    """Found with the other settings (the case above shows that they fail in one line)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(["--tp", "2", "--dist-init-addr", "127.0.0.1:29500", *flags])


def test_a_settings_error_names_the_flags_but_not_inside_a_file_name(tmp_path: Path) -> None:
    """The error read "no --generation-config.json"."""
    with pytest.raises(SystemExit) as exited:
        main(["--device", "cpu", "--generation-config", str(tmp_path)])
    assert f"--generation-config {tmp_path}: no generation_config.json" in str(exited.value.code)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--router-policy", "random"], "--router-policy picks among --dp replicas"),
        (["--structured-outputs-in-reasoning"], "--structured-outputs-in-reasoning needs --reas"),
        (["--dist-init-addr", "127.0.0.1:29500"], "--dist-init-addr is where TP ranks meet"),
        (["--gpu-memory-utilization", "0.5", "--max-kv-tokens", "4096"], "would size: give one"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--shell"], "--shell chats with node"),
    ],
)
def test_an_option_that_would_change_nothing_is_refused(flags: list[str], message: str) -> None:
    """Each was accepted and ignored: a router policy with no replicas, a grammar held over a
    thinking no parser finds, a meeting address for one rank, a share of memory beside a fixed
    KV cache, a shell on a node that serves no API."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(["--device", "cpu", *flags])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weights": False}, "holds no *.safetensors weights"),
        ({"tokenizer": False}, "has no tokenizer.json"),
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"hidden_size": 32}, "has shape (512, 64), expected (512, 32)"),  # read from headers
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints are not"),
    ],
)
def test_a_model_directory_that_cannot_be_served_fails_in_one_line(
    tmp_path: Path, change: dict, message: str
) -> None:
    run = _launch("--device", "cpu", "--model", str(_model_dir(tmp_path, **change)))
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and message in lines[0], run.stderr


def test_a_setting_only_the_engine_can_check_names_the_process_in_one_line(
    tmp_path: Path,
) -> None:
    """A tensor the checkpoint lacks: only the model, once built, names every tensor it needs;
    the scheduler finds out before it reads a weight, and says so."""
    name = "model.layers.1.mlp.up_proj.weight"
    run = _launch("--device", "cpu", "--model", str(_model_dir(tmp_path, drop=name)))
    assert run.returncode == 1
    assert "Traceback" not in run.stderr, run.stderr
    assert (
        f"minisgl: scheduler-0: checkpoint {tmp_path / 'model'} is missing tensor(s) '{name}'"
        in run.stderr
    )
    assert "a process exited during start-up: scheduler-0 (exit code 1)" in run.stderr


def test_a_kv_cache_larger_than_the_machine_fails_in_one_line() -> None:
    """torch's allocation error was a traceback."""
    run = _launch("--device", "cpu", "--max-kv-tokens", str(10**12))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "minisgl: scheduler-0: --max-kv-tokens 1000000000000: its KV cache needs" in run.stderr


def test_weights_larger_than_the_machine_fail_in_one_line(tmp_path: Path) -> None:
    """The weights were allocated until torch's error (a traceback), or until the kernel's OOM
    killer ended some process; here 3,840 GiB of dummy weights."""
    model = _model_dir(tmp_path, weights=False, intermediate_size=2**30)
    run = _launch("--device", "cpu", "--model", str(model), "--dummy-weights")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert (
        "minisgl: scheduler-0: the weights need 3840.0 GiB, more than the " in run.stderr
        and " GiB of this machine" in run.stderr
    ), run.stderr


def test_the_launcher_reaches_its_own_server_under_an_http_proxy(tmp_path: Path) -> None:
    """Its start-up /health calls went to the proxy (a dead one here): it waited for good."""
    proxy = f"http://127.0.0.1:{free_port()}"
    env = {"http_proxy": proxy, "HTTP_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""}
    server = ServerProcess(tmp_path, "--served-model-name", "m", env=env)
    try:
        answer = server.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()


def test_vllm_s_dtype_names_are_taken() -> None:
    for name, dtype in (("half", torch.float16), ("float", torch.float32)):
        assert resolve_dtype(name, torch.device("cpu")) == dtype


def _cuda_available() -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"  # fmt: skip


def test_version_and_serve_model_as_in_vllm() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "minisgl", "--version"], capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.startswith("minisgl ")
    args = parse_args(["serve", str(DEFAULT_MODEL_PATH), "--seed", "7"])
    assert args.engine.model_path == DEFAULT_MODEL_PATH and args.scheduler.seed == 7
    assert parse_args([str(DEFAULT_MODEL_PATH)]).engine.model_path == DEFAULT_MODEL_PATH


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::", "http://[::1]:8000"),
        ("::1", "http://[::1]:8000"),
        ("fe80::1", "http://[fe80::1]:8000"),
        ("example.org", "http://example.org:8000"),
    ],
)
def test_the_url_the_launcher_prints_and_polls_brackets_ipv6_hosts(host: str, url: str) -> None:
    assert _base_url(parse_args(["--host", host, "--port", "8000"])) == url


def test_a_chat_template_file_is_read_whatever_its_path_holds(tmp_path: Path) -> None:
    """A path with `{` was taken for the template's text, and every chat prompt was the path."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t{1}" / "tmpl.jinja"
    path.parent.mkdir()
    path.write_text(template)
    assert parse_args(["--chat-template", str(path)]).chat_template == template
    assert parse_args(["--chat-template", template]).chat_template == template


def test_the_api_key_comes_from_the_environment_too() -> None:
    environ = {"MINISGL_API_KEY": "from-env"}
    assert parse_args([], environ).api_key == "from-env"
    assert parse_args(["--api-key", "given"], environ).api_key == "given"
    assert parse_args([], {}).api_key is None
    assert parse_args([], {"MINISGL_API_KEY": ""}).api_key is None  # set empty: no key


def test_vllm_flags_reach_the_server(tmp_path: Path) -> None:
    """--max-model-len, --gpu-memory-utilization, --seed, --log-level, --chat-template and two
    --served-model-name names, on a server given its model as an argument."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    server = ServerProcess(
        tmp_path,
        str(DEFAULT_MODEL_PATH), "--max-model-len", "300", "--gpu-memory-utilization", "0.02",
        "--seed", "3", "--log-level", "warning",
        "--chat-template", template, "--served-model-name", "first", "second",
    )  # fmt: skip
    try:
        cards = httpx.get(server.url + "/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["first", "second"]
        assert cards[0]["max_model_len"] == 300
        body = {"messages": [{"role": "user", "content": "Once upon"}], "max_tokens": 2}
        reply = server.post("/v1/chat/completions", json={**body, "model": "second"}).json()
        # as vLLM's: any name is served, the first names the reply
        assert reply["model"] == "first"
        # the template writes the content alone: no role markers around it
        assert reply["usage"]["prompt_tokens"] == 2
        assert server.post("/v1/chat/completions", json={**body, "model": "x"}).status_code == 404
        assert "INFO:" not in server.log()  # --log-level warning: no access log lines either
    finally:
        server.stop()


def test_a_process_that_exits_now_exits_with_its_code_even_if_its_stdout_is_closed() -> None:
    """A TP rank leaves with exit_now (no interpreter teardown); a stdout that fails to flush
    must not keep it alive."""
    script = (
        "import sys\n"
        "from minisgl.utils.process import exit_now\n"
        "print('buffered', end='')\n"
        "sys.stdout.close()\n"
        "exit_now(3)\n"
        "sys.exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 3, done.stderr


def test_a_stop_signal_as_a_child_starts_waits_until_the_launcher_holds_the_child() -> None:
    """CI: a SIGTERM landing between a child's start and its place in the launcher's list left a
    child no stop joined, alive after the launcher had exited. The signal is raised here as
    start_child returns (a profile hook)."""

    def raise_at_return(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is start_child.__code__:
            sys.setprofile(None)
            signal.raise_signal(signal.SIGTERM)

    def stop(signum: int, frame: Any) -> None:  # as the launcher's handler
        raise _Stop

    def spawned() -> set[int]:
        return set(spawned_children(os.getpid()))

    before = spawned()
    procs: list = []
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        sys.setprofile(raise_at_return)
        with pytest.raises(_Stop):
            _start_into(procs, "probe", "time:sleep", 60)
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGTERM, previous)
        started = spawned() - before
        for pid in started:
            os.kill(pid, signal.SIGKILL)
    assert [proc.pid for proc in procs] == list(started)
    for proc in procs:
        proc.join(10)


def test_a_stop_while_the_server_starts_ends_it_at_once() -> None:
    """SIGTERM as the children appear, before the API server takes SIGTERM (it ignores it until
    its own handler is set): nothing is served yet, so nothing is drained. It waited for the
    drain's --shutdown-timeout + 5 s (16 s) before. Every child the launcher spawned is gone
    when it exits (multiprocessing's resource tracker, not one of them, leaves a moment later:
    CI once found it alive)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--port", str(free_port()), "--device", "cpu"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        started: list[int] = []
        while time.monotonic() < deadline:
            started = spawned_children(launcher.pid)
            with contextlib.suppress(OSError):  # a child that exited since
                if "api-server" in map(process_name, started):
                    break
            time.sleep(0.002)
        else:
            raise AssertionError("no API server started")
        stop = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        assert time.monotonic() - stop < 6
        assert not [pid for pid in started if alive(pid)]
    finally:
        launcher.kill()
        launcher.wait()


def test_host_ipv6_any_takes_ipv4_clients_too(tmp_path: Path) -> None:
    """`--host ::` listens on every address, as vLLM's does (Linux's IPV6_V6ONLY default): it
    refused IPv4 clients (asyncio's IPv6 socket is IPv6-only)."""
    server = ServerProcess(tmp_path, "--host", "::")
    try:
        for base in (f"http://127.0.0.1:{server.port}", f"http://[::1]:{server.port}"):
            assert httpx.get(base + "/health", timeout=10).status_code == 200, base
    finally:
        server.stop()


def test_enable_log_requests_logs_each_request_as_it_ends(tmp_path: Path) -> None:
    """vLLM's flag: a line per request (it was only uvicorn's access line: no id, no tokens; and
    none for a client that left before its answer, or one the queue refused)."""
    server = ServerProcess(tmp_path, "--enable-log-requests", "--max-queued-requests", "2")
    try:

        def post(rid: str, route: str, body: dict) -> httpx.Response:
            return httpx.post(
                server.url + route, json=body, headers={"X-Request-Id": rid}, timeout=60
            )

        whole = {"prompt": "Once", "max_tokens": 3, "n": 2, "ignore_eos": True}
        assert post("first", "/v1/completions", whole).status_code == 200
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "ignore_eos": True, "stream": True}  # fmt: skip
        assert post("second", "/v1/chat/completions", chat).status_code == 200
        assert post("third", "/v1/completions", {"prompt": [1, 10**6]}).status_code == 400
        assert post("fourth", "/v1/completions", {"prompt": "Once", "n": 3}).status_code == 400
        log = server.log()
        assert re.search(
            r"request first \(/v1/completions\): 200, prompt \d+ tokens \(\d+ "
            r"cached\), 6 generated, finish length,length, [\d.]+ s",
            log,
        ), log
        assert "request second (/v1/chat/completions): 200 (streamed), prompt" in log
        assert "2 generated, finish length, " in log
        assert "request third (/v1/completions): 400 token id" in log
        assert "request fourth (/v1/completions): 400 3 sequences (prompts x n) exceed" in log
    finally:
        server.stop()
