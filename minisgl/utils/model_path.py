import json
from pathlib import Path
from typing import Any

from minisgl.config import ConfigError
from minisgl.core import SamplingParams

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "assets" / "stories260K"


def resolve_model_path(model: str | Path | None) -> Path:
    """A local model directory; None means the embedded stories260K model."""
    path = DEFAULT_MODEL_PATH if model is None else Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{path} is not a model directory (no config.json); no download is attempted"
        )
    return path


def load_eos_token_ids(model_path: str | Path) -> tuple[int, ...]:
    """Every eos id the model may emit: generation_config.json's list (else config.json's) and
    the tokenizer's own eos_token, as vLLM and SGLang stop on both (a fine-tune may change the
    tokenizer's alone)."""
    path = Path(model_path)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (path / name).is_file():
            eos = json.loads((path / name).read_text()).get("eos_token_id")
            if eos is not None:
                ids = list(eos) if isinstance(eos, list) else [eos]
                break
    token = _tokenizer_eos(path)
    if token is not None and token not in ids:
        ids.append(token)
    return tuple(ids)


def _tokenizer_eos(path: Path) -> int | None:
    config, vocabulary = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config.is_file() and vocabulary.is_file()):
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    if isinstance(eos, dict):  # an AddedToken's fields
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    from tokenizers import Tokenizer  # here: this package's top level imports nothing heavy

    return Tokenizer.from_file(str(vocabulary)).token_to_id(eos)


# generation_config.json's fields that vLLM takes as the defaults of a request's sampling
# parameters (not its max_new_tokens, which vLLM takes as the default max_tokens: the routes keep
# their own, OpenAI's)
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: str, model_path: Path) -> dict[str, Any]:
    """The sampling parameters of a request that leaves them out, as vLLM's --generation-config
    says: "auto", the model's generation_config.json's; "vllm", none (SamplingParams' own); else
    those of the generation_config.json in the folder it names. Raises ConfigError for a file
    that cannot be read or values SamplingParams refuses."""
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else Path(generation_config).expanduser()
    file = folder / "generation_config.json"
    if not file.is_file():
        if generation_config == "auto":
            return {}
        raise ConfigError(f"--generation-config {generation_config}: no generation_config.json")
    try:
        data = json.loads(file.read_text())
        defaults = {name: data[name] for name in _SAMPLING_DEFAULTS if data.get(name) is not None}
        SamplingParams(**defaults)
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{file} cannot be read as sampling defaults: {e}") from None
    return defaults
