"""What a benchmark run shows: the side-by-side table (one line a request rate, and the offline
run), and the PNG of latency and throughput against the request rate."""

from pathlib import Path
from typing import Any

from common import Row, print_table

BUSY_WARNING = 0.8  # a client process busier than this may have held the requests back


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _rate_text(rate: float | str) -> str:
    return f"{rate:g}" if isinstance(rate, float) else rate


def table_rows(runs: list[dict[str, Any]], offline: dict[str, Any] | None) -> list[Row]:
    rows = [
        {
            "request rate": run["request_rate"],
            "done": run["completed"],
            "failed": run["failed"],
            "req/s": run["request_throughput"],
            "goodput": run["request_goodput"],
            "out tok/s": run["output_throughput"],
            "TTFT p50": run["ttft_ms"]["p50"],
            "TTFT p99": run["ttft_ms"]["p99"],
            "TPOT p50": run["tpot_ms"]["p50"],
            "ITL p50": run["itl_ms"]["p50"],
            "ITL p99": run["itl_ms"]["p99"],
            "E2EL p50": run["e2el_ms"]["p50"],
            "E2EL p99": run["e2el_ms"]["p99"],
            "cache hit %": _percent(run["prefix_cache"]["hit_rate"]),
            "client busy %": _percent(run["client"]["max_busy_share"]),
            "online/offline": run["online_offline_ratio"],
        }
        for run in runs
    ]
    if offline is not None:
        rows.append(
            {
                "request rate": "offline",
                "done": offline["requests"],
                "out tok/s": offline["output_throughput"],
            }
        )
    return rows


def print_report(runs: list[dict[str, Any]], offline: dict[str, Any] | None) -> None:
    print("\nlatencies in ms; client busy: the busiest client process's CPU share")
    print_table(table_rows(runs, offline))
    for run in runs:
        if run["client"]["max_busy_share"] > BUSY_WARNING:
            print(
                f"warning: at request rate {run['request_rate']} a client process was "
                f"{100 * run['client']['max_busy_share']:.0f} % busy: the client may be the "
                "bottleneck (more --num-client-procs)"
            )
        for error in run["errors"]:
            print(f"request rate {run['request_rate']}: a request failed: {error}")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """TTFT, ITL and E2E latency (p50 and p99) and output tok/s against the request rate, one
    point a run, in the order run."""
    import matplotlib  # only when a plot is asked for: it is an optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(runs)))
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    for i, metric in enumerate(("ttft_ms", "itl_ms", "e2el_ms")):
        for p, style in (("p50", "-"), ("p99", "--")):
            values = [run[metric][p] for run in runs]
            latency.plot(
                x,
                [float("nan") if v is None else v for v in values],
                style,
                color=f"C{i}",
                marker="o",
                label=f"{metric.removesuffix('_ms').upper()} {p}",
            )
    latency.set(yscale="log", ylabel="latency (ms)", title="latency")
    latency.legend(fontsize="small")
    throughput.plot(x, [run["output_throughput"] for run in runs], marker="o")
    throughput.set(ylabel="output tok/s", title="throughput", ylim=(0, None))
    for ax in (latency, throughput):
        ax.set_xticks(x, [_rate_text(run["request_rate"]) for run in runs])
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
