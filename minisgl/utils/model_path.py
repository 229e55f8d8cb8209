import json
from pathlib import Path

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
    """Every eos id the model may emit: generation_config.json's list, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        file = Path(model_path) / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()
