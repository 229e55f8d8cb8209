import json
from pathlib import Path

from tokenizers import Tokenizer

from minisgl.config import ConfigError

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
    return Tokenizer.from_file(str(vocabulary)).token_to_id(eos)
