"""The package's layers: no module imports a layer above its own, the wire types and the front-end
processes stay free of torch, and `minisgl --help` answers without it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import tokenizer_library_imports_torch

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"
# each module's layer, by the longest matching prefix; a module may import its own layer and
# those below it. engine.context is what the layers read of the engine: it sits below them
LAYERS = {
    "minisgl.core": 0,
    "minisgl.config": 0,
    "minisgl.utils": 0,
    "minisgl.messages": 1,
    "minisgl.distributed": 1,
    "minisgl.kernel": 2,
    "minisgl.kvcache": 3,
    "minisgl.engine.context": 3,
    "minisgl.attention": 4,
    "minisgl.layers": 4,
    "minisgl.moe": 4,
    "minisgl.models": 5,
    "minisgl.engine": 6,
    "minisgl.scheduler": 7,
    "minisgl.tokenizer": 7,
    "minisgl.llm": 8,
    "minisgl.server": 8,
    "minisgl": 9,  # the package's own __init__ and __main__
}
HEAVY = ("torch", "triton", "numpy", "safetensors")


def _layer(module: str) -> int:
    return next(LAYERS[p] for p in sorted(LAYERS, key=len, reverse=True) if module.startswith(p))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, with_type_checking: bool) -> list[str]:
    """The absolute names a module imports at run time (and under TYPE_CHECKING, if asked)."""
    tree = ast.parse(path.read_text())
    package = (
        _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    )
    skipped: set[int] = set()
    if not with_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                skipped.update(id(n) for n in ast.walk(node))
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{prefix}.{base}" if base else prefix
            names.append(base)
    return names


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_no_module_imports_a_layer_above_its_own(path: Path) -> None:
    module = _module_name(path)
    above = [
        name
        for name in _imports(path, with_type_checking=False)
        if name.startswith("minisgl.") and _layer(name) > _layer(module)
    ]
    assert not above, f"{module} (layer {_layer(module)}) imports {above}"


def test_core_and_config_import_nothing_of_the_package_even_for_type_checking() -> None:
    for name in ("core.py", "config.py"):
        imported = _imports(PACKAGE / name, with_type_checking=True)
        assert not [n for n in imported if n.startswith("minisgl")], (name, imported)


def test_wire_types_import_no_scheduler_and_nothing_heavy() -> None:
    for name in _imports(PACKAGE / "messages.py", with_type_checking=True):
        assert not name.startswith(("minisgl.scheduler", "minisgl.engine", *HEAVY)), name


def _loaded(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "module",
    ["minisgl.server.api_server", "minisgl.tokenizer.worker", "minisgl.server.launch", "minisgl"],
)
def test_front_end_modules_import_no_torch(module: str) -> None:
    if module == "minisgl.tokenizer.worker" and tokenizer_library_imports_torch():
        pytest.skip("this transformers imports torch for its tokenizers")
    loaded = _loaded(f"import {module}")
    assert not loaded & {"torch", "triton", "minisgl.engine.engine", "minisgl.scheduler.scheduler"}


def test_help_answers_without_torch() -> None:
    """The whole --help path, main() included, in one process: then the modules it loaded."""
    code = (
        "import sys; sys.argv = ['minisgl', '--help']\nfrom minisgl.server.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('MODULES', ' '.join(sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    help_text, _, modules = out.rpartition("MODULES ")
    assert "--max-model-len" in help_text
    loaded = set(modules.split())
    assert "minisgl.server.cli" in loaded
    assert "torch" not in loaded and "transformers" not in loaded
