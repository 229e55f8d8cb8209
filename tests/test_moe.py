"""Qwen3-MoE: which layers are sparse, how expert checkpoints load, and the same greedy tokens as
Hugging Face batched, chunked and through prefix reuse (test_models checks one request at a time
and the logits; test_server_tp checks --tp 2)."""

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from minisgl import LLM, SamplingParams
from minisgl.config import ConfigError
from minisgl.distributed import TPInfo, set_tp_info
from minisgl.models import CausalLM, ModelConfig
from minisgl.models.weights import load_weights
from minisgl.moe import MOE_BACKENDS
from minisgl.moe.torch_backend import TorchMoE
from minisgl.utils.hf import cached_load_hf_config

from .conftest import DEVICE, assert_same_or_near_tie, hf_greedy, hf_model
from .test_models import corrupt_copy

PRESET = Path(__file__).resolve().parents[1] / "benchmark" / "presets" / "qwen3-30b-a3b"
# 8 experts, top-2, and layer 1 of 3 dense
MOE = {"num_experts": 8, "num_hidden_layers": 3, "mlp_only_layers": [1]}


@pytest.fixture(scope="module")
def moe_path(checkpoint) -> Path:
    return checkpoint("qwen3_moe", **MOE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 5, 17, 33, 64, 80] + [rng.randint(1, 80) for _ in range(6)]
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_reference(moe_path, prompts) -> tuple[transformers.PreTrainedModel, list[list[int]]]:
    hf = hf_model(moe_path)
    return hf, [hf_greedy(hf, p, 12) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    ("mlp_only_layers", "decoder_sparse_step", "num_experts"),
    [([], 1, 4), ([0, 2], 1, 4), ([], 2, 4), ([], 3, 4), ([1], 2, 4), ([], 1, 0)],
)
def test_sparse_layers_are_the_ones_hf_makes_sparse(
    mlp_only_layers: list[int], decoder_sparse_step: int, num_experts: int
) -> None:
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=6, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, moe_intermediate_size=8, num_experts=num_experts,
        num_experts_per_tok=min(2, num_experts), mlp_only_layers=mlp_only_layers,
        decoder_sparse_step=decoder_sparse_step, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(config)
    sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    moe = ModelConfig.from_hf(config).moe
    assert (moe.layers if moe is not None else ()) == sparse


def test_the_random_router_uses_every_expert_without_ties(prompts, hf_reference) -> None:
    """Ties in the router would make the top-k (and so the test) arbitrary: randomize_ must give
    it weights that tell the experts apart."""
    hf, _ = hf_reference
    with torch.no_grad():
        ids = [t for p in prompts for t in p]
        out = hf(torch.tensor([ids], device=hf.device), output_router_logits=True)
    for logits in out.router_logits:  # [tokens, experts] of each sparse layer
        top = logits.float().topk(3, dim=-1)
        assert len(set(top.indices[:, :2].flatten().tolist())) == MOE["num_experts"]
        assert (top.values[:, 1] - top.values[:, 2]).min() > 1e-4  # the top-2's edge


def test_batched_generate_equals_hf(moe_path, prompts, hf_reference) -> None:
    hf, want = hf_reference
    llm = LLM(str(moe_path), device=DEVICE, dtype="float32", max_kv_tokens=4096)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, reference, out in zip(prompts, want, outputs, strict=True):
        assert_same_or_near_tie(hf, prompt, out["token_ids"], reference)


def test_chunked_prefill_equals_hf(moe_path, prompts, hf_reference) -> None:
    hf, want = hf_reference
    llm = LLM(str(moe_path), device=DEVICE, dtype="float32", max_kv_tokens=4096, chunk_size=8)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, reference, out in zip(prompts, want, outputs, strict=True):
        assert_same_or_near_tie(hf, prompt, out["token_ids"], reference)


def test_a_request_reusing_a_cached_prefix_equals_hf(moe_path, prompts, hf_reference) -> None:
    hf, _ = hf_reference
    first, second = prompts[4], prompts[4][:40] + prompts[3]
    llm = LLM(str(moe_path), device=DEVICE, dtype="float32", max_kv_tokens=4096)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in (first, second)]
    assert outs[0]["cached_tokens"] == 0 and outs[1]["cached_tokens"] >= 32
    for prompt, out in zip((first, second), outs, strict=True):
        assert_same_or_near_tie(hf, prompt, out["token_ids"], hf_greedy(hf, prompt, 12))
    llm.scheduler.check_integrity()


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Each sparse layer's experts, in place, in transformers' fused 3-D layout."""
    experts = range(MOE["num_experts"])
    for layer in range(MOE["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue
        gate_up = [
            torch.cat([tensors.pop(f"{prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
            for e in experts
        ]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in experts]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)


def _load(path: Path, tp: TPInfo) -> dict[str, torch.Tensor]:
    """Rank tp.rank's weights, as the engine loads them."""
    config = ModelConfig.from_hf(cached_load_hf_config(path))
    set_tp_info(tp.rank, tp.size)
    try:
        with torch.device("meta"):
            model = CausalLM(config, TorchMoE(), torch.device("cpu"))
    finally:
        set_tp_info(0, 1)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return dict(load_weights(path, config, expected, tp, torch.device("cpu"), torch.float32))


def test_fused_and_per_expert_checkpoints_load_alike_on_each_rank(moe_path, tmp_path) -> None:
    fused = corrupt_copy(moe_path, tmp_path / "fused", _fuse_experts)
    whole = _load(moe_path, TPInfo(0, 1))
    ranks = []
    for tp in (TPInfo(0, 1), TPInfo(0, 2), TPInfo(1, 2)):
        per_expert, from_fused = _load(moe_path, tp), _load(fused, tp)
        assert per_expert.keys() == from_fused.keys()
        assert all(torch.equal(t, from_fused[name]) for name, t in per_expert.items())
        if tp.size == 2:
            ranks.append(per_expert)
    # each rank holds its slice of every expert's intermediate dimension
    name = "model.layers.0.mlp.experts."
    gate_up = [r[name + "gate_up_proj"].chunk(2, dim=1) for r in ranks]
    assert torch.equal(torch.cat([g for g, _ in gate_up], 1), whole[name + "gate_up_proj"][:, :32])
    assert torch.equal(torch.cat([u for _, u in gate_up], 1), whole[name + "gate_up_proj"][:, 32:])
    down = torch.cat([r[name + "down_proj"] for r in ranks], dim=2)
    assert torch.equal(down, whole[name + "down_proj"])


EXPERT = "model.layers.2.mlp.experts.{}.up_proj.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(EXPERT.format(5)), rf"missing tensor\(s\) '{EXPERT.format(5)}'$"),
        (
            lambda t: t.update({EXPERT.format(8): torch.zeros(32, 64)}),
            rf"unexpected tensor '{EXPERT.format(8)}'",
        ),
        # both were read, the fused ones last: a layer of zeros, no error
        (
            lambda t: t.update({"model.layers.2.mlp.experts.down_proj": torch.zeros(8, 64, 32)}),
            r"'model\.layers\.2\.mlp\.experts\.down_proj' is stored both whole and in parts",
        ),
        # read as expert 5 too, and taken if read last
        (
            lambda t: t.update({EXPERT.format("05"): torch.zeros(32, 64)}),
            rf"unexpected tensor '{EXPERT.format('05')}'",
        ),
    ],
    ids=["missing", "past-the-last", "fused-and-per-expert", "index-written-twice"],
)
def test_a_missing_or_extra_expert_tensor_is_named(moe_path, tmp_path, edit, message) -> None:
    dst = corrupt_copy(moe_path, tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=message):
        LLM(str(dst), device=DEVICE, dtype="float32", max_kv_tokens=256, max_model_len=256)


def test_triton_backend_generates_hf_tokens_in_static_graph_batches(
    moe_path, prompts, hf_reference
) -> None:
    """Six requests: prefills through the grouped GEMM, decode steps (the grouped GEMM too)
    padded to the graph runner's static batch of 8 (its CPU twin here, a CUDA graph on a GPU).
    Six tokens each: the interpreter runs each program as Python."""
    hf, want = hf_reference
    llm = LLM(
        str(moe_path), device=DEVICE, dtype="float32", moe_backend="triton", max_kv_tokens=4096,
        cuda_graph_max_bs=8,
    )  # fmt: skip
    assert llm.engine.graph_runner is not None and llm.engine.graph_runner.sizes[-1] == 8
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts[:6], params, use_tqdm=False)
    for prompt, reference, out in zip(prompts, want, outputs, strict=False):
        assert_same_or_near_tie(hf, prompt, out["token_ids"], reference[:6])


def test_auto_moe_backend_is_triton_on_cuda_and_torch_on_cpu(monkeypatch) -> None:
    assert MOE_BACKENDS.resolve("auto", "cuda") == "triton"
    assert MOE_BACKENDS.resolve("auto", "cpu") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set only for CPU runs
    with pytest.raises(ConfigError, match="the triton MoE backend does not run on cpu"):
        MOE_BACKENDS.resolve("triton", "cpu")


def test_an_unknown_moe_backend_is_refused_in_one_line(moe_path) -> None:
    with pytest.raises(
        ConfigError, match=r"^unknown MoE backend 'fused'; supported: auto, torch, triton$"
    ):
        LLM(str(moe_path), device=DEVICE, moe_backend="fused", max_kv_tokens=256)


def test_the_qwen3_30b_a3b_preset_parses_as_the_real_model() -> None:
    config = ModelConfig.from_hf(cached_load_hf_config(PRESET))
    assert config.architecture == "Qwen3MoeForCausalLM" and config.qk_norm
    assert (config.num_layers, config.hidden_size, config.head_dim) == (48, 2048, 128)
    assert (config.num_qo_heads, config.num_kv_heads, config.vocab_size) == (32, 4, 151936)
    assert config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (128, 8, 768)
    assert config.moe.renormalize and config.moe.layers == tuple(range(48))


def test_the_preset_serves_dummy_weights_at_a_reduced_size(tmp_path: Path) -> None:
    """The preset's config with fewer and smaller layers and experts, its tokenizer as it is."""
    for f in PRESET.iterdir():
        (tmp_path / f.name).symlink_to(f.resolve())
    (tmp_path / "config.json").unlink()
    config = json.loads((PRESET / "config.json").read_text())
    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=16, moe_intermediate_size=32)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**config, **small}))
    llm = LLM(
        str(tmp_path), device=DEVICE, dummy_weights=True, max_kv_tokens=256, max_model_len=256
    )
    out = llm.generate(["Mixture of experts"], GREEDY, use_tqdm=False)[0]
    assert len(out["token_ids"]) == 12
    backend = "triton" if DEVICE == "cuda" else "torch"  # auto's choice
    assert any(f"MoE {backend}" in line for line in llm.engine.summary())
