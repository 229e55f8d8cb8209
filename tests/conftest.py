"""Shared fixtures: small random-weight Hugging Face checkpoints written with save_pretrained, and
the Hugging Face reference computations the engine is checked against.

MINISGL_TEST_DEVICE=cuda runs the suite on a GPU (default: cpu); --long runs tests/stress at its
long size.
"""

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import transformers

from minisgl.utils import DEFAULT_MODEL_PATH

if TYPE_CHECKING:
    from minisgl import LLM

DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")
# where TP 2 runs: on two GPUs (NCCL) when the suite runs on CUDA and has them, else on the CPU
# (gloo): one GPU cannot hold two ranks
TP_DEVICE = "cuda" if DEVICE == "cuda" and torch.cuda.device_count() >= 2 else "cpu"
if DEVICE == "cpu":
    # Triton kernels run in Triton's interpreter on CPU tensors; read when triton.jit decorates them
    os.environ.setdefault("TRITON_INTERPRET", "1")
# a process of a test that dies of a signal (SIGABRT, SIGSEGV) prints every thread's traceback
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
ASSETS = Path(__file__).parent / "assets"
QWEN3_TOKENIZER = ASSETS / "qwen3-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="run the stress scenarios (tests/stress) at their long size: more clients, "
        "requests and fuzzed bodies",
    )


@pytest.fixture(scope="session")
def size(request: pytest.FixtureRequest) -> Callable[[int, int], int]:
    """size(ci, long): a stress scenario's number at the CI size, or with --long the long one."""
    long = request.config.getoption("--long")
    return lambda ci, long_size: long_size if long else ci


# small shapes: GQA everywhere, head_dim != hidden / heads for Qwen3
_BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
)
ARCH_CONFIGS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(tie_word_embeddings=False, sliding_window=None),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=True, head_dim=32),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            tie_word_embeddings=False,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy decoding varies (HF's 0.02 init repeats one token)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the experts' stacked ones
                std = 0.3 if "embed_tokens" in name else 0.2
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:  # norm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))


def save_random_checkpoint(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: str = "stories",
    max_shard_size: str | None = None,
    eos_token_id: int | list[int] | None = None,
    **overrides,
) -> Path:
    """Write a random-weight checkpoint of `arch` with transformers' own save_pretrained."""
    config_cls, model_cls, extra = ARCH_CONFIGS[arch]
    kwargs = {**_BASE, **extra, **overrides}
    if tokenizer == "qwen3" and "vocab_size" not in overrides:
        kwargs["vocab_size"] = 151936  # Qwen3's padded embedding
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    source = QWEN3_TOKENIZER if tokenizer == "qwen3" else DEFAULT_MODEL_PATH
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    if eos_token_id is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(arch, **options) -> directory; each distinct checkpoint is written once."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama", **options) -> Path:
        key = json.dumps([arch, options], sort_keys=True)
        if key not in made:
            made[key] = save_random_checkpoint(tmp_path_factory.mktemp(arch), arch, **options)
        return made[key]

    return make


@pytest.fixture(scope="module")
def stories_llm() -> "LLM":
    """The offline engine on the embedded stories260K model, fp32: a module's reference."""
    from minisgl import LLM  # after TRITON_INTERPRET is set, above

    return LLM(device=DEVICE, dtype="float32", max_kv_tokens=2048)


@pytest.fixture(scope="session")
def qwen3_path(checkpoint) -> str:
    """A small random Qwen3 with the real Qwen3 tokenizer (chat template, multi-byte text)."""
    return str(checkpoint("qwen3", tokenizer="qwen3"))


def hf_model(path: Path) -> transformers.PreTrainedModel:
    """The fp32 Hugging Face reference, on the device the engine under test uses; a mixture of
    experts with its eager experts (its batched ones differ in the last bits)."""
    config = transformers.AutoConfig.from_pretrained(path)
    options = {"experts_implementation": "eager"} if getattr(config, "num_experts", 0) else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options)
    return model.to(DEVICE).eval()


@torch.no_grad()
def hf_greedy(
    model: transformers.PreTrainedModel, prompt_ids: list[int], max_new_tokens: int
) -> list[int]:
    """Hugging Face greedy decoding, eos ignored (the reference for token-by-token checks)."""
    out = model.generate(
        torch.tensor([prompt_ids], device=model.device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,  # never stop early: the engine runs with ignore_eos
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_top2_gap(model: transformers.PreTrainedModel, ids: list[int]) -> float:
    """HF's gap between the two largest next-token logits after `ids` (near-tie evidence)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])


def assert_same_or_near_tie(
    model: transformers.PreTrainedModel,
    prompt_ids: list[int],
    got: list[int],
    want: list[int],
    tol: float = 1e-4,
) -> None:
    """Equal token by token, or the first difference is a near-tie in HF's own logits (< tol:
    fp32's 1e-4 by default)."""
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    gap = hf_top2_gap(model, prompt_ids + want[:i])
    assert gap < tol, (
        f"first difference at token {i}: got {got[i]}, want {want[i]}, top-2 gap {gap}"
    )


def assert_same_or_near_tie_as(got: list[int], reference: dict) -> None:
    """Equal to another engine's result (`LLM.generate`'s, asked with logprobs=2) token by token,
    or the first difference is a near tie in that engine's own logits: its two most likely tokens
    there within 1e-4 (logprobs differ from the logits by one constant per row)."""
    want = reference["token_ids"]
    if got == want:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert i is not None, f"{len(got)} tokens, {len(want)} wanted, the same up to there"
    top = reference["logprobs"][i]["top_logprobs"]
    gap = top[0]["logprob"] - top[1]["logprob"]
    assert gap < 1e-4, f"first difference at token {i}: got {got[i]}, want {want[i]}, gap {gap}"


def step_tokens(scheduler) -> list[tuple[int, int]]:
    """One scheduler step's (rid, token) pairs."""
    out = scheduler.step()
    return list(zip(out.rids, out.token_ids, strict=True))


@functools.cache
def tokenizer_library_imports_torch() -> bool:
    """Whether this transformers' PreTrainedTokenizerFast imports torch by itself (5.17 does, 5.24
    does not): then the tokenizer process holds torch through no import of ours."""
    code = "import sys\nfrom transformers import PreTrainedTokenizerFast\nprint('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return run.stdout.strip() == "True"
