"""vllm-router (vLLM's router, a Rust binary on PyPI) in front of the --dp replicas: the router
process's entry point, with its settings from the server's, and the one call the launcher makes
on it, when a replica has died.

It forwards each body as the client sent it, every field (the replica honours or refuses each),
adding SGLang's own fields (protocol.py takes them). It calls each replica's /health (at start,
then every _HEALTH_INTERVAL_S; a replica failing _HEALTH_FAILURES checks in a row gets no more
requests). A request whose replica cannot be reached or answers 408, 429, 500, 502, 503 or 504 is
tried again (5 attempts in all, within about half a second) on the replica the policy then
picks, which may be the same one: a replica that died is taken out at once (leave_out) rather
than by the health checks, seconds later. A stream that broke off is not tried again. On SIGTERM
it answers what it has forwarded, then exits."""

import math
import urllib.parse
import urllib.request

from minisgl.utils.process import stop_on_sigterm

from .args import ServerArgs
from .direct_http import open_direct

_HEALTH_INTERVAL_S = 2
_HEALTH_FAILURES = 2
# the router's own default would cut requests at 30 min; a year stays within tokio's timers
_NO_TIMEOUT_S = 365 * 24 * 3600


def run_router(args: ServerArgs, replica_urls: list[str], metrics_port: int) -> None:
    """The process entry point: the router on the server's host and port, with its API key (which
    it checks on each request and sends to the replicas, which check it too); serves until
    SIGTERM, then drains."""
    from vllm_router.launch_router import RouterArgs, launch_router  # the launcher needs none

    stop_on_sigterm()
    launch_router(
        RouterArgs(
            worker_urls=replica_urls,
            host=args.host,
            port=args.port,
            policy=args.router_policy,
            api_key=args.api_key,
            prometheus_host=args.host,
            prometheus_port=metrics_port,
            # the launcher starts the router once every replica answers /health: its first
            # check finds them ready, and a later one need not wait the default 30 s
            worker_startup_check_interval=1,
            health_check_interval_secs=_HEALTH_INTERVAL_S,
            health_failure_threshold=_HEALTH_FAILURES,
            # its breaker counts a replica's 4xx (the client's error) against the replica; a
            # dead replica is taken out by leave_out and the health checks instead
            disable_circuit_breaker=True,
            # the router's empty list allows every origin
            cors_allowed_origins=[] if "*" in args.allowed_origins else list(args.allowed_origins),
            # the replicas stop a request at --request-timeout: the router waits for that answer
            request_timeout_secs=(
                _NO_TIMEOUT_S
                if args.request_timeout is None
                else math.ceil(args.request_timeout) + 5
            ),
            # Rust's level names: "warning" is not one, and it logged at info
            log_level="warn" if args.log_level == "warning" else args.log_level,
        )
    )


def leave_out(router_url: str, replica_url: str, api_key: str | None) -> None:
    """Have the router send no more requests to the replica at `replica_url`; raises OSError
    if the router cannot be asked."""
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    query = urllib.parse.urlencode({"url": replica_url})
    removal = urllib.request.Request(
        f"{router_url}/remove_worker?{query}", headers=headers, method="POST"
    )
    open_direct(removal, timeout=5).close()
