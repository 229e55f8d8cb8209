"""HTTP calls from the launcher and the shell to this server's own processes: never through a
proxy. Under `http_proxy` urllib sent the launcher's start-up /health calls to the proxy, and
the launcher waited for good."""

import urllib.request
from http.client import HTTPResponse

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def open_direct(request: str | urllib.request.Request, timeout: float | None) -> HTTPResponse:
    """urllib.request.urlopen without proxies; timeout None: wait as long as it takes."""
    return _DIRECT.open(request, timeout=timeout)
