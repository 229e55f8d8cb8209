"""The generic decoder and the loader: the same function as Hugging Face, for every architecture."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from minisgl import LLM, SamplingParams
from minisgl.config import ConfigError, EngineConfig
from minisgl.core import Req
from minisgl.engine.context import ForwardBatch, forward_context, load_inputs
from minisgl.engine.engine import Engine, upload
from minisgl.kvcache.manager import KVCacheManager
from minisgl.models.config import ModelConfig
from minisgl.scheduler.batch_builder import build_batch
from minisgl.scheduler.token_table import TokenTable
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import DEVICE, hf_greedy, hf_model, save_random_checkpoint

LLAMA3_ROPE = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
# (architecture, checkpoint options): GQA everywhere; tied and untied; Llama 3.1 rope scaling;
# config flags that Hugging Face reads for one architecture and not another;
# Qwen3's head_dim differs from hidden / heads; one checkpoint sharded over several files;
# Qwen3-MoE with 4 or 8 experts, top-2 or top-1, a dense layer among the sparse ones (by
# mlp_only_layers or by decoder_sparse_step), weights renormalised or not
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", LLAMA3_ROPE),
    "mistral": ("mistral", {}),
    "mistral-attention-bias": ("mistral", {"attention_bias": True}),  # which HF's Mistral ignores
    "qwen2": ("qwen2", {}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", {}),
    "qwen3-sharded": ("qwen3", {"max_shard_size": "100KB", "tie_word_embeddings": False}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-8-experts-top1": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 1}),
    "qwen3-moe-mlp-only-layer": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3-moe-sparse-step-2": ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),
    "qwen3-moe-unnormalized": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen3-moe-sharded": ("qwen3_moe", {"max_shard_size": "100KB", "num_experts": 8}),
}
PROMPT = [7, 300, 12, 99, 450, 3, 81, 81, 200, 17, 64, 5]


def prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through the real pool and attention backend: the
    engine's forward, with every token's row as a "last" one."""
    layout = engine.layout
    kv = KVCacheManager(layout.num_pages, layout.page_size, layout.page_table_width, "naive")
    kv.admit(0, [])
    assert kv.reserve(0, len(ids))
    tokens = TokenTable(layout)
    tokens.write(0, 0, ids)
    req = Req(rid=0, token_ids=ids, params=SamplingParams(), seed=0, slot=0)
    batch = build_batch(
        [req], [0], [len(ids)], layout, None, kv.take_page_writes(), tokens.take_writes()
    )
    inputs = upload(replace(batch.inputs, last_indices=np.arange(len(ids))), engine.device)
    input_ids, out_loc = load_inputs(inputs, engine.page_table, engine.token_table)
    metadata = engine.attn_backend.prepare(batch)
    with forward_context(ForwardBatch(False, inputs, out_loc, engine.attn_backend, metadata)):
        return engine.model.forward(input_ids).float().cpu()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_greedy_tokens_equal_hf(checkpoint, variant: str) -> None:
    arch, options = VARIANTS[variant]
    path = checkpoint(arch, **options)
    if "max_shard_size" in options:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    assert_logits_and_greedy_tokens_equal_hf(path)


def assert_logits_and_greedy_tokens_equal_hf(path: Path) -> None:
    hf = hf_model(path)
    with torch.no_grad():
        want_logits = hf(torch.tensor([PROMPT], device=hf.device)).logits[0].cpu()
    llm = LLM(str(path), device=DEVICE, dtype="float32", max_kv_tokens=512, max_model_len=512)
    got_logits = prefill_logits(llm.engine, PROMPT)
    assert (got_logits - want_logits).abs().max().item() < 1e-5

    want = hf_greedy(hf, PROMPT, 32)
    assert len(set(want)) > 8, "the random model should not repeat one token"
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    assert out[0]["token_ids"] == want


def test_a_top_level_original_context_overrides_the_llama3_scalings(
    checkpoint, tmp_path: Path
) -> None:
    # as transformers 5 reads it; save_pretrained would have made the two agree
    path = shutil.copytree(checkpoint("llama", **LLAMA3_ROPE), tmp_path / "top-level")
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"]["original_max_position_embeddings"] == 64
    config["original_max_position_embeddings"] = 16
    (path / "config.json").write_text(json.dumps(config))
    assert_logits_and_greedy_tokens_equal_hf(path)


def test_embedded_model_continues_once_upon_a_time_as_recorded() -> None:
    # recorded with HF's greedy generate (fp32) on the same checkpoint
    reference = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
                 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394]  # fmt: skip
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=1024, max_model_len=1024)
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )
    assert out[0]["token_ids"] == reference
    assert out[0]["text"].startswith(", there was a little girl named Lily.")


def test_embedded_model_stops_on_either_eos_id() -> None:
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=2048)
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=500), use_tqdm=False
    )
    # recorded with HF: generation_config's eos is [2, 1] and the story ends on id 1 after 342 tokens
    assert out[0]["finish_reason"] == "stop"
    assert len(out[0]["token_ids"]) == 342 and out[0]["token_ids"][-1] == 1


def test_the_tokenizers_eos_stops_generation_too(tmp_path: Path) -> None:
    """As in vLLM and SGLang: the configs name no eos here, the tokenizer's eos_token does."""
    path = _copy(DEFAULT_MODEL_PATH, tmp_path / "m")
    for name in ("generation_config.json", "config.json"):
        config = json.loads((path / name).read_text())
        config.pop("eos_token_id")
        (path / name).write_text(json.dumps(config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<s>"  # id 1, which ends the recorded story
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with LLM(str(path), device=DEVICE, dtype="float32", max_kv_tokens=2048) as llm:
        params = SamplingParams(temperature=0, max_tokens=500)
        out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] is None
    assert len(out["token_ids"]) == 342 and out["token_ids"][-1] == 1


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    config = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        Engine(EngineConfig(model_path=tmp_path, device=DEVICE, max_kv_tokens=64, max_model_len=64))


def corrupt_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_wrong_shape_names_the_tensor_and_file(checkpoint, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t: dict) -> None:
        t[name] = torch.zeros(3, 64)

    path = corrupt_copy(checkpoint("llama"), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"{name}.*model\.safetensors.*\(3, 64\)"):
        Engine(EngineConfig(model_path=path, device=DEVICE, max_kv_tokens=64, max_model_len=64))


def test_missing_tensor_is_named(checkpoint, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    path = corrupt_copy(checkpoint("llama"), tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing.*{name}"):
        Engine(EngineConfig(model_path=path, device=DEVICE, max_kv_tokens=64, max_model_len=64))


def test_unexpected_tensor_is_named(checkpoint, tmp_path: Path) -> None:
    name = "model.layers.7.mlp.up_proj.weight"  # the model has 2 layers

    def edit(t: dict) -> None:
        t[name] = torch.zeros(128, 64)

    path = corrupt_copy(checkpoint("llama"), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"unexpected.*{name}.*model\.safetensors"):
        Engine(EngineConfig(model_path=path, device=DEVICE, max_kv_tokens=64, max_model_len=64))


@pytest.mark.parametrize(
    ("arch", "flag"),
    [("llama", "attention_bias"), ("llama", "mlp_bias"), ("qwen3", "attention_bias")],
)
def test_biases_we_do_not_model_are_refused(tmp_path: Path, arch: str, flag: str) -> None:
    # Hugging Face puts attention_bias on o_proj too and mlp_bias on the MLP: neither is modelled
    path = save_random_checkpoint(tmp_path / arch, arch, **{flag: True})
    with pytest.raises(ValueError, match=rf"unsupported .*ForCausalLM setting {flag}: true"):
        Engine(EngineConfig(model_path=path, device=DEVICE, max_kv_tokens=64, max_model_len=64))


def test_a_stored_head_under_tied_embeddings_loads_only_if_it_is_the_embedding(
    checkpoint, tmp_path: Path
) -> None:
    tied = checkpoint("llama", tie_word_embeddings=True)
    embedding = load_file(tied / "model.safetensors")["model.embed_tokens.weight"]

    def store_head(head: torch.Tensor):
        return lambda t: t.update({"lm_head.weight": head})

    same = corrupt_copy(tied, tmp_path / "same", store_head(embedding.clone()))
    llm = LLM(str(same), device=DEVICE, dtype="float32", max_kv_tokens=64, max_model_len=64)
    assert torch.equal(llm.engine.model.model.embed_tokens.weight.cpu(), embedding)
    llm.close()
    other = corrupt_copy(tied, tmp_path / "other", store_head(embedding + 1))
    with pytest.raises(ValueError, match=r"ties the word embeddings.*lm_head\.weight.*differs"):
        Engine(EngineConfig(model_path=other, device=DEVICE, max_kv_tokens=64, max_model_len=64))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _llm(path: Path) -> LLM:
    return LLM(str(path), device=DEVICE, dtype="float32", max_kv_tokens=64, max_model_len=64)


def test_a_shard_the_index_names_but_the_directory_lacks_fails_before_loading(
    checkpoint, tmp_path: Path
) -> None:
    path = _copy(
        checkpoint("qwen3", max_shard_size="100KB", tie_word_embeddings=False), tmp_path / "m"
    )
    last = sorted(path.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(ConfigError, match=rf"model\.safetensors\.index\.json names {last.name}"):
        _llm(path)


def test_an_index_naming_no_file_is_refused(checkpoint, tmp_path: Path) -> None:
    path = _copy(
        checkpoint("qwen3", max_shard_size="100KB", tie_word_embeddings=False), tmp_path / "m"
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = 3
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"index\.json cannot be read.*must be file names"):
        _llm(path)


def test_a_tensor_stored_in_two_files_is_refused(checkpoint, tmp_path: Path) -> None:
    path = _copy(
        checkpoint("qwen3", max_shard_size="100KB", tie_word_embeddings=False), tmp_path / "m"
    )
    (path / "model.safetensors.index.json").unlink()  # every *.safetensors file is read
    shards = sorted(path.glob("model-*.safetensors"))
    first, last = shards[0], shards[-1]
    name = next(iter(load_file(first)))
    tensors = load_file(last)
    save_file({**tensors, name: load_file(first)[name] + 1}, last)
    with pytest.raises(ConfigError, match=rf"{re.escape(name)}.*both {first.name} and {last.name}"):
        _llm(path)


def test_a_truncated_file_fails_before_loading(checkpoint, tmp_path: Path) -> None:
    path = _copy(checkpoint("llama"), tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"model\.safetensors cannot be read"):
        _llm(path)


def test_a_tensor_of_no_float_type_is_refused(checkpoint, tmp_path: Path) -> None:
    name = "model.norm.weight"
    path = corrupt_copy(
        checkpoint("llama"), tmp_path / "bad", lambda t: t.update({name: t[name].to(torch.int32)})
    )
    with pytest.raises(ConfigError, match=rf"{name}.*is I32, not a float type"):
        _llm(path)


def test_model_safetensors_is_the_checkpoint_whatever_lies_beside_it(
    checkpoint, tmp_path: Path
) -> None:
    """As Hugging Face loads it: an adapter or a consolidated copy beside it is no part of it."""
    path = _copy(checkpoint("llama"), tmp_path / "m")
    save_file({"embed_tokens.weight": torch.zeros(2, 2)}, path / "consolidated.safetensors")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    tokens = []
    for model in (path, checkpoint("llama")):
        with _llm(model) as llm:
            tokens.append(llm.generate([PROMPT], greedy, use_tqdm=False)[0]["token_ids"])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    ("config", "label"),
    [
        # Hugging Face builds Qwen3-MoE (sliding on every layer); it was served as Qwen3, whose
        # window follows layer_types, and its tokens differed past the window
        (
            Qwen3MoeConfig(use_sliding_window=True, sliding_window=16, mlp_only_layers=[0, 1]),
            "Qwen3ForCausalLM",
        ),
        (Qwen3Config(), "Qwen3MoeForCausalLM"),  # it was an AttributeError (num_experts)
    ],
)
def test_architectures_and_model_type_that_disagree_are_refused(config, label: str) -> None:
    config.num_hidden_layers = 2
    config.architectures = [label]
    with pytest.raises(ConfigError, match=rf"architectures \({label}\) and model_type .* disagree"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantized checkpoints"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_config_fields_we_cannot_honour_are_refused(
    checkpoint, tmp_path: Path, fields: dict, match: str
) -> None:
    path = _copy(checkpoint("llama"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(ConfigError, match=match):
        _llm(path)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
        (
            {"num_experts_per_tok": 5},
            r"num_experts_per_tok \(5\) must be in \[1, num_experts \(4\)\]",
        ),
    ],
)
def test_moe_settings_out_of_range_are_refused(fields: dict, match: str) -> None:
    config = Qwen3MoeConfig(**{"num_experts": 4, "num_experts_per_tok": 2, **fields})
    config.architectures = ["Qwen3MoeForCausalLM"]
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize(("max_window_layers", "positions"), [(4, 4096), (2, 256)])
def test_qwen2s_window_caps_the_context_only_if_a_layer_slides(
    max_window_layers: int, positions: int
) -> None:
    config = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=256,
        max_window_layers=max_window_layers, max_position_embeddings=4096,
    )  # fmt: skip
    config.architectures = ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf(config).max_position_embeddings == positions


@pytest.mark.parametrize(
    ("config", "positions"),
    [
        # Hugging Face's Mistral slides whatever use_sliding_window says (it was left uncapped)
        (MistralConfig(sliding_window=256, use_sliding_window=False), 256),
        (Qwen2Config(sliding_window=256, use_sliding_window=False), 4096),
        # its generate caches Llama 4's attention chunks as a window (it was left uncapped)
        (LlamaConfig(attention_chunk_size=128), 128),
        (LlamaConfig(attention_chunk_size=512, sliding_window=256), 256),
        # Hugging Face's Qwen3-MoE slides on every layer, whatever layer_types says (it was
        # left uncapped, and its tokens differed from HF's past the window)
        (
            Qwen3MoeConfig(
                num_hidden_layers=2,
                use_sliding_window=True,
                sliding_window=256,
                layer_types=["full_attention"] * 2,
            ),
            256,
        ),
    ],
)
def test_the_span_hugging_face_attends_over_caps_the_context(config, positions: int) -> None:
    config.max_position_embeddings = 4096
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    assert ModelConfig.from_hf(config).max_position_embeddings == positions
