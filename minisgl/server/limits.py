"""What one request may ask for. OpenAI's own limits by default (n, prompts per request); the
others bound the work one request can make the server do before anything is generated."""

from dataclasses import dataclass

from minisgl.config import ConfigError, check_positive
from minisgl.core import SamplingParams
from minisgl.messages import encode

from .errors import ApiError


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128
    max_prompts: int = 2048
    max_request_bytes: int = 32 << 20
    max_header_bytes: int = 64 << 10  # request line, headers, trailers (nginx: 32 KiB, Node: 16)
    max_stop_strings: int = 64
    max_stop_length: int = 1024  # characters
    # each choice carries its own copy of these lists to the tokenizer and the scheduler
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    # every choice of every prompt carries its own copy of the params through the tokenizer to
    # the scheduler: 2,048 prompts x n 128 of the largest params above would be ~21 GB
    max_params_bytes: int = 64 << 20
    # 256 prompts of 2,000 tokens with 20 each: a 731 MB answer, 4.2 GB more in the API server
    max_prompt_logprobs: int = 1 << 20
    max_queued_requests: int | None = None  # engine requests waiting for a first token

    def __post_init__(self) -> None:
        check_positive(
            self, "max_n", "max_prompts", "max_request_bytes", "max_header_bytes", "max_stop_strings",
            "max_stop_length", "max_stop_token_ids", "max_logit_bias", "max_params_bytes",
            "max_prompt_logprobs",
        )  # fmt: skip
        check_positive(self, "max_queued_requests", optional=True)
        least = len(encode(SamplingParams()))
        if self.max_params_bytes < least:
            raise ConfigError(
                f"max_params_bytes must be at least {least}, the bytes of one choice's default "
                f"sampling parameters, not {self.max_params_bytes}: every request would be refused"
            )

    def check(self, n: int, num_prompts: int, params: SamplingParams) -> None:
        """Raise ApiError(400), naming the field, for a request over a limit."""
        stops = params.stop
        for ok, field, message in (
            (n <= self.max_n, "n", f"n must be at most {self.max_n}"),
            (
                num_prompts <= self.max_prompts,
                "prompt",
                f"at most {self.max_prompts} prompts per request",
            ),
            (
                len(stops) <= self.max_stop_strings,
                "stop",
                f"at most {self.max_stop_strings} stop strings",
            ),
            (
                all(len(s) <= self.max_stop_length for s in stops),
                "stop",
                f"a stop string has at most {self.max_stop_length} characters",
            ),
            (
                len(params.stop_token_ids) <= self.max_stop_token_ids,
                "stop_token_ids",
                f"at most {self.max_stop_token_ids} stop_token_ids",
            ),
            (
                len(params.logit_bias) <= self.max_logit_bias,
                "logit_bias",
                f"logit_bias biases at most {self.max_logit_bias} tokens",
            ),
        ):
            if not ok:
                raise ApiError(400, message, param=field)
        carried = len(encode(params)) * n * num_prompts
        if carried > self.max_params_bytes:
            raise ApiError(
                400,
                f"{num_prompts} prompts x n {n} would carry {carried:,} bytes of sampling "
                f"parameters to the engine; at most {self.max_params_bytes:,} (--max-params-bytes): "
                "send fewer prompts or choices, or shorter stop lists",
            )
