from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> factory, so that a new backend is one file and one `register` call."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def wrap(factory: Callable[..., T]) -> Callable[..., T]:
            assert name not in self._factories, f"{self.kind} {name!r} registered twice"
            self._factories[name] = factory
            return factory

        return wrap

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; supported: {', '.join(self.names())}")
        return self._factories[name]
