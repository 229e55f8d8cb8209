from dataclasses import dataclass, field

from minisgl.config import EngineConfig, SchedulerConfig

from .limits import RequestLimits
from .reasoning import REASONING_PARSERS
from .tool_parser import TOOL_PARSERS

# vllm-router's policies that need nothing more from a worker than minisgl serves
ROUTER_POLICIES = ("cache_aware", "round_robin", "random")
# the scheduler's heartbeat and idle loop come every 0.5 s: a shorter limit fails a healthy server
MIN_HEALTH_TIMEOUT_S = 1.0
# 11.6 days: the launcher waits on its children in milliseconds that poll() takes as 32 bits
# (--shutdown-timeout 3e6 ended the drain in an OverflowError, the launcher hung)
MAX_TIMEOUT_S = 1_000_000


@dataclass(frozen=True)
class ServerArgs:
    """What to serve and how; `minisgl --help` explains each option."""

    engine: EngineConfig  # tp_rank is 0; the launcher derives each rank's config
    scheduler: SchedulerConfig
    served_model_name: str  # what replies name
    served_model_aliases: tuple[str, ...] = ()  # other names clients may send
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)  # CORS: the browser pages that may call the API
    shell: bool = False
    chat_template: str | None = None  # a Jinja template used instead of the model's
    tool_call_parser: str | None = None  # reads tool calls out of replies (tool_choice auto)
    reasoning_parser: str | None = None  # splits replies into reasoning_content and content
    structured_outputs_in_reasoning: bool = False  # a grammar holds the thinking too
    generation_config: str = "auto"  # where requests' sampling defaults come from (vLLM's flag)
    limits: RequestLimits = field(default_factory=RequestLimits)
    request_timeout: float | None = None  # seconds a request may run; None: no limit
    shutdown_timeout: float = 10.0  # seconds running requests may finish after SIGTERM
    health_timeout: float = 20.0  # /health fails once the scheduler was silent this long
    timeout_keep_alive: int = 5  # seconds a connection may stay idle, between or in requests
    log_level: str = "info"
    enable_log_requests: bool = False  # a line per request as it ends (vLLM's flag)
    node_rank: int = 0  # which of engine.nnodes machines this is; node 0 serves the API
    dist_init_addr: str | None = None  # HOST:PORT where node 0 meets the others (TCP)
    dp_size: int = 1  # replicas behind vllm-router; 1: one server, no router
    router_policy: str = "cache_aware"  # how vllm-router picks a replica for a request

    def __post_init__(self) -> None:
        self._check_nodes()
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1-65535, not {self.port}")
        if not self.host:  # the launcher would wait for good on http://:PORT
            raise ValueError("--host must name an address (0.0.0.0: every interface)")
        if not all([self.served_model_name, *self.served_model_aliases]):
            raise ValueError("--served-model-name must not be empty")
        timeouts = {
            "--shutdown-timeout": self.shutdown_timeout,
            "--health-timeout": self.health_timeout,
            "--timeout-keep-alive": self.timeout_keep_alive,
            "--request-timeout": self.request_timeout,
        }
        for flag, seconds in timeouts.items():
            if seconds is not None and not 0 < seconds <= MAX_TIMEOUT_S:
                raise ValueError(
                    f"{flag} must be a finite number of seconds > 0 and at most "
                    f"{MAX_TIMEOUT_S:,}, not {seconds}"
                )
        if self.health_timeout < MIN_HEALTH_TIMEOUT_S:
            raise ValueError(
                f"--health-timeout must be at least {MIN_HEALTH_TIMEOUT_S:g} s: the scheduler "
                "reports every 0.5 s"
            )
        if self.dp_size < 1:
            raise ValueError(f"--dp must be >= 1, not {self.dp_size}")
        if self.structured_outputs_in_reasoning and self.reasoning_parser is None:
            raise ValueError(
                "--structured-outputs-in-reasoning needs --reasoning-parser (which tells the "
                "thinking from the answer)"
            )
        if self.dp_size > 1 and not self.allowed_origins:
            raise ValueError("--dp: vllm-router cannot refuse every origin (--allowed-origins [])")
        for flag, name, known in [
            ("--tool-call-parser", self.tool_call_parser, TOOL_PARSERS),
            ("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS),
            ("--router-policy", self.router_policy, ROUTER_POLICIES),
        ]:
            if name is not None and name not in known:
                raise ValueError(f"{flag} must be one of {', '.join(known)}, not {name!r}")

    def _check_nodes(self) -> None:
        nnodes = self.engine.nnodes
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"--node-rank must be in 0-{nnodes - 1}, not {self.node_rank}")
        if self.shell and self.node_rank > 0:
            raise ValueError(
                "--shell chats with node 0's API: a node of --node-rank > 0 serves none"
            )
        if self.dist_init_addr is None:
            if nnodes > 1:
                raise ValueError(f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (node 0's)")
            return
        if self.engine.tp_size == 1:
            raise ValueError("--dist-init-addr is where TP ranks meet: give --tp N (N > 1) too")
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--dist-init-addr must be HOST:PORT, not {self.dist_init_addr!r}")
