"""The op layer (chapter 2): BaseOP's naming and loading rules, and the reference ops against HF."""

import re
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from minisgl.config import ConfigError
from minisgl.distributed import set_tp_info
from minisgl.kernel import torch_ops
from minisgl.layers import BaseOP, OPList, StateLessOP, get_rope
from minisgl.layers.linear import LinearRowParallel
from minisgl.models import CausalLM, ModelConfig
from minisgl.models.decoder import DecoderLayer
from minisgl.moe.torch_backend import TorchMoE
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import torch_dtype

from .conftest import QWEN3_TOKENIZER


class Leaf(BaseOP):
    def __init__(self) -> None:
        self.weight = torch.zeros(2)
        self._scratch = torch.zeros(3)  # underscore: not a weight


class Tree(BaseOP):
    def __init__(self) -> None:
        self.head = Leaf()
        self.layers = OPList([Leaf(), Leaf()])
        self.rope = StateLessOP()
        self.scale = torch.ones(1)


@pytest.fixture(autouse=True)
def single_rank() -> Iterator[None]:
    """Each test starts, and leaves the modules after it, at one rank."""
    set_tp_info(0, 1)
    yield
    set_tp_info(0, 1)


def test_state_dict_names_follow_attribute_paths_and_skip_underscored() -> None:
    assert sorted(Tree().state_dict()) == [
        "head.weight",
        "layers.0.weight",
        "layers.1.weight",
        "scale",
    ]


def test_load_replaces_tensors_without_copying() -> None:
    tree = Tree()
    new = {name: torch.full_like(t, 7.0) for name, t in tree.state_dict().items()}
    expected = dict(new)
    tree.load_state_dict(new)
    assert new == {}, "loading consumes the dict"
    for name, t in tree.state_dict().items():
        assert t is expected[name]


def test_leftover_key_is_an_error() -> None:
    tree = Tree()
    state = {name: t.clone() for name, t in tree.state_dict().items()}
    state["layers.2.weight"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"Unexpected keys.*layers\.2\.weight"):
        tree.load_state_dict(state)


def test_wrong_shape_names_the_tensor() -> None:
    state = {name: t.clone() for name, t in Tree().state_dict().items()}
    state["layers.1.weight"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"layers\.1\.weight"):
        Tree().load_state_dict(state)


def test_meta_build_costs_no_memory_then_loads() -> None:
    config = ModelConfig.from_hf(cached_load_hf_config(QWEN3_TOKENIZER))
    with torch.device("meta"), torch_dtype(torch.bfloat16):
        layer = DecoderLayer(config, 0, TorchMoE(), torch.device("cpu"))
    state = layer.state_dict(prefix="model.layers.0")
    assert {t.device.type for t in state.values()} == {"meta"}
    assert state["model.layers.0.self_attn.qkv_proj.weight"].shape == (4096, 1024)
    assert state["model.layers.0.mlp.gate_up_proj.weight"].shape == (6144, 1024)
    assert "model.layers.0.self_attn.q_norm.weight" in state
    real = {name: torch.randn(t.shape, dtype=t.dtype) for name, t in state.items()}
    layer.load_state_dict(real, prefix="model.layers.0")
    assert layer.self_attn.qkv_proj.weight.device.type == "cpu"


def test_an_unsupported_rope_scaling_fails_in_the_config() -> None:
    """Before anything is built (the server's preflight reads the config)."""
    hf = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf(hf)


def test_a_meta_build_puts_the_rope_table_on_the_given_device() -> None:
    with torch.device("meta"):
        rope = get_rope(16, 64, 1234.5, None, torch.device("cpu"))
    assert rope._cos_sin_cache.device.type == "cpu" and rope._cos_sin_cache.shape == (64, 16)


def test_tied_lm_head_has_no_weight_of_its_own() -> None:
    config = ModelConfig.from_hf(cached_load_hf_config(QWEN3_TOKENIZER))
    with torch.device("meta"):
        model = CausalLM(config, TorchMoE(), torch.device("cpu"))
    names = model.state_dict()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_rmsnorm_matches_hf_exactly() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 1024), torch.randn(1024)
    ref = Qwen3RMSNorm(1024, eps=1e-6)
    ref.weight.data.copy_(w)
    assert (torch_ops.rmsnorm(x, w, 1e-6) - ref(x)).abs().max().item() == 0.0


def test_fused_add_rmsnorm_returns_norm_and_new_residual() -> None:
    torch.manual_seed(0)
    x, residual, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    want_residual = x + residual
    want = torch_ops.rmsnorm(want_residual, w, 1e-5)
    torch_ops.fused_add_rmsnorm(x, residual, w, 1e-5)
    assert torch.equal(residual, want_residual) and torch.equal(x, want)


@pytest.mark.parametrize("splits", [2, 4])
def test_linear_split_k_partial_sums_add_up_to_the_product(splits: int) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(24, 64)
    parts = torch_ops.linear_split_k(x, w, splits)
    assert parts.shape == (splits, 5, 24)
    torch.testing.assert_close(parts.sum(0), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_fused_add_rmsnorm_of_partial_sums_equals_that_of_their_sum() -> None:
    torch.manual_seed(0)
    parts, residual, w = torch.randn(4, 3, 64), torch.randn(3, 64), torch.randn(64)
    x, want_residual = parts.sum(0), residual.clone()
    want = torch_ops.fused_add_rmsnorm(x, want_residual, w, 1e-5)
    got = torch_ops.fused_add_rmsnorm(parts, residual, w, 1e-5)
    assert got.data_ptr() == parts.data_ptr()  # the norm goes into the first partial
    assert torch.equal(residual, want_residual) and torch.equal(got, want)


def test_row_parallel_linear_returns_partial_sums_when_split(monkeypatch) -> None:
    torch.manual_seed(0)
    layer = LinearRowParallel(64, 24)
    layer.weight = torch.randn(24, 64)
    x = torch.randn(5, 64)
    assert layer.forward(x).shape == (5, 24)  # on CPU the default rule never splits
    monkeypatch.setenv("MINISGL_SPLIT_K", "4")
    parts = layer.forward(x)
    assert parts.shape == (4, 5, 24)
    torch.testing.assert_close(parts.sum(0), x @ layer.weight.t(), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("MINISGL_SPLIT_K", "5")  # does not divide 64 input features: no split
    assert layer.forward(x).shape == (5, 24)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_matches_hf_exactly(scaling: dict | None) -> None:
    head_dim, theta, max_pos = 128, 500000.0, 4096
    hf_config = LlamaConfig(
        hidden_size=16 * head_dim, num_attention_heads=16, max_position_embeddings=max_pos,
        rope_theta=theta, rope_scaling=scaling,
    )  # fmt: skip
    hf_rope = LlamaRotaryEmbedding(hf_config)
    scaled = tuple(sorted(scaling.items())) if scaling else None
    rope = get_rope(head_dim, max_pos, theta, scaled, torch.device("cpu"))
    torch.manual_seed(0)
    pos = torch.tensor([0, 7, 100, 4095])
    q, k = torch.randn(4, 16 * head_dim), torch.randn(4, 8 * head_dim)
    cos, sin = hf_rope(q, pos[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(4, 16, head_dim).transpose(0, 1)[None],
        k.view(4, 8, head_dim).transpose(0, 1)[None],
        cos,
        sin,
    )
    rope.forward(pos, q, k)
    assert (q.view(4, 16, head_dim).transpose(0, 1) - q_ref[0]).abs().max().item() == 0.0
    assert (k.view(4, 8, head_dim).transpose(0, 1) - k_ref[0]).abs().max().item() == 0.0


def test_vocab_parallel_indexing_masks_other_shards() -> None:
    w = torch.arange(20.0).view(10, 2)  # the vocabulary slice [5, 15)
    ids = torch.tensor([3, 5, 14, 15, 9])
    out = torch_ops.indexing(w, ids, vocab_range=(5, 10))
    assert out.tolist() == [[0, 0], [0, 1], [18, 19], [0, 0], [8, 9]]


def test_silu_and_mul_matches_the_unmerged_mlp() -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(torch_ops.silu_and_mul(torch.cat([gate, up], dim=-1)), want)


MOE_SHAPE = transformers.Qwen3MoeConfig(
    num_hidden_layers=2, hidden_size=16, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=20, moe_intermediate_size=10, num_experts=4, num_experts_per_tok=2,
    mlp_only_layers=[0], architectures=["Qwen3MoeForCausalLM"],
)  # fmt: skip


@pytest.mark.parametrize(
    ("tp", "refusal"),
    [
        (2, None),
        (3, "--tp 3 must divide the model's attention heads (8)"),
        (4, "--tp 4 must divide the model's expert intermediate size (10)"),
        (8, "--tp 8 must divide the model's MLP intermediate size (20)"),
    ],
)
def test_a_tp_size_is_refused_before_the_build_exactly_when_the_build_would_fail(
    tp: int, refusal: str | None
) -> None:
    """The heads, the KV heads (shared by ranks past their number) and each MLP split evenly."""
    config = ModelConfig.from_hf(MOE_SHAPE)
    set_tp_info(0, tp)
    with torch.device("meta"):
        if refusal is None:
            config.check_tp(tp)
            CausalLM(config, TorchMoE(), torch.device("cpu"))
        else:
            with pytest.raises(ConfigError, match=re.escape(refusal)):
                config.check_tp(tp)
            with pytest.raises(ConfigError):
                CausalLM(config, TorchMoE(), torch.device("cpu"))


def test_ranks_past_the_kv_heads_share_them_only_in_whole_groups() -> None:
    dense = replace(ModelConfig.from_hf(MOE_SHAPE), moe=None, intermediate_size=24)
    config = replace(dense, num_qo_heads=12, num_kv_heads=3)
    config.check_tp(6)  # two ranks share each KV head
    set_tp_info(0, 6)
    with torch.device("meta"):
        CausalLM(config, TorchMoE(), torch.device("cpu"))
    with pytest.raises(ConfigError, match=re.escape("--tp 4 must divide the model's 3 KV heads")):
        config.check_tp(4)
    set_tp_info(0, 4)
    with torch.device("meta"), pytest.raises(ConfigError):
        CausalLM(config, TorchMoE(), torch.device("cpu"))
