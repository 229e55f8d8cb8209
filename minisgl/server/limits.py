"""What one request may ask for. OpenAI's own limits by default (n, prompts per request); the
others bound the work one request can make the server do before anything is generated."""

from dataclasses import dataclass

from minisgl.config import check_positive

from .errors import ApiError


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128
    max_prompts: int = 2048
    max_request_bytes: int = 32 << 20
    max_stop_strings: int = 64
    max_stop_length: int = 1024  # characters
    max_queued_requests: int | None = None  # engine requests waiting for a first token

    def __post_init__(self) -> None:
        check_positive(
            self, "max_n", "max_prompts", "max_request_bytes", "max_stop_strings", "max_stop_length"
        )
        check_positive(self, "max_queued_requests", optional=True)

    def check(self, n: int, num_prompts: int, stops: tuple[str, ...]) -> None:
        """Raise ApiError(400) for a request over a limit."""
        for ok, message in (
            (n <= self.max_n, f"n must be at most {self.max_n}"),
            (num_prompts <= self.max_prompts, f"at most {self.max_prompts} prompts per request"),
            (len(stops) <= self.max_stop_strings, f"at most {self.max_stop_strings} stop strings"),
            (
                all(len(s) <= self.max_stop_length for s in stops),
                f"a stop string has at most {self.max_stop_length} characters",
            ),
        ):
            if not ok:
                raise ApiError(400, message)
