import importlib
import os
from collections.abc import Callable
from typing import Generic, TypeVar

from minisgl.config import ConfigError

T = TypeVar("T")


def triton_runs_on(device_type: str) -> bool:
    """Triton compiles for CUDA; on the CPU only its interpreter runs it (TRITON_INTERPRET=1)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class Registry(Generic[T]):
    """Name -> factory, so that a new backend is one file and one `register` call. A factory is
    named by "module:attribute" and imported only when chosen: listing the names (the CLI's
    --help) imports no backend, and a backend that needs triton costs nothing until used.

    "auto" stands for the registry's default on a device type, so each default has one home: a
    name, or names in order of preference, the first that runs; an entry may say which device
    types it runs on."""

    def __init__(self, kind: str, auto: dict[str, str | tuple[str, ...]] | None = None) -> None:
        self.kind = kind
        self._auto = auto or {}
        # name -> (its factory's "module:attribute", the device types it runs on; None: all)
        self._entries: dict[str, tuple[str, Callable[[str], bool] | None]] = {}

    def register(
        self, name: str, target: str, runs_on: Callable[[str], bool] | None = None
    ) -> None:
        if name in self._entries or name == "auto":
            raise ConfigError(f"{self.kind} {name!r} registered twice")
        self._entries[name] = (target, runs_on)

    def choices(self) -> list[str]:
        """What a user may ask for: "auto" (when it means something) and every name."""
        return (["auto"] if self._auto else []) + sorted(self._entries)

    def resolve(self, name: str, device_type: str) -> str:
        """The entry `name` stands for on `device_type`; raises ConfigError if there is none."""
        if name == "auto" and device_type in self._auto:
            preferred = self._auto[device_type]
            names = (preferred,) if isinstance(preferred, str) else preferred
            name = next((n for n in names if self._runs(n, device_type)), names[-1])
        if not self._runs(name, device_type):
            raise ConfigError(f"the {name} {self.kind} does not run on {device_type}")
        return name

    def _runs(self, name: str, device_type: str) -> bool:
        runs_on = self._entry(name)[1]
        return runs_on is None or runs_on(device_type)

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as `name` (resolve "auto" and check the device first)."""
        module, _, attribute = self._entry(name)[0].partition(":")
        return getattr(importlib.import_module(module), attribute)

    def _entry(self, name: str) -> tuple[str, Callable[[str], bool] | None]:
        if name not in self._entries:
            choices = ", ".join(self.choices())
            raise ConfigError(f"unknown {self.kind} {name!r}; supported: {choices}")
        return self._entries[name]
