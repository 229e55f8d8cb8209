"""The book's example scripts run and print what the chapters say they print."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tiny_engine_matches_hf_on_the_embedded_model() -> None:
    out = run("ch00_tiny_engine.py")
    assert "generated: ', there was a little girl named Lily." in out
    assert "matches Hugging Face token by token: True" in out


def test_tiny_engine_handles_qwen3_qk_norm(checkpoint) -> None:
    out = run("ch00_tiny_engine.py", str(checkpoint("qwen3")), "--tokens", "8")
    assert "Qwen3ForCausalLM" in out and "matches Hugging Face token by token: True" in out


def test_layers_example_lists_merged_weights_and_exact_ops(checkpoint) -> None:
    out = run("ch02_layers.py", str(checkpoint("qwen3")))
    for name in ("self_attn.qkv_proj.weight", "self_attn.q_norm.weight", "mlp.gate_up_proj.weight"):
        assert f"model.layers.0.{name}" in out
    assert "q_proj" not in out.replace("qkv_proj", "")
    assert "RMSNorm max error: 0.0" in out and "RoPE max error: 0.0" in out
