"""One TP rank of test_tp's sampling test, in a spawned process: it imports only minisgl, so that
it starts without the test suite's Hugging Face imports."""

from multiprocessing.queues import Queue

from minisgl.config import EngineConfig, SchedulerConfig
from minisgl.core import SamplingParams
from minisgl.engine.engine import Engine
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils import DEFAULT_MODEL_PATH
from minisgl.utils.process import exit_now

Requests = list[tuple[int, list[int], SamplingParams]]


def sample(
    rank: int, dist_init_method: str, device: str, seed: int, requests: Requests
) -> dict[int, list[int]]:
    """Each request's tokens, run to its end on this rank, whose scheduler draws the requests'
    seeds from `seed`."""
    config = EngineConfig(
        DEFAULT_MODEL_PATH, device=device, dtype="float32", max_kv_tokens=4096,
        max_running_requests=8, tp_rank=rank, tp_size=2, dist_init_method=dist_init_method,
    )  # fmt: skip
    engine = Engine(config)
    scheduler = Scheduler(SchedulerConfig(seed=seed), engine, ())
    scheduler.add_requests(requests)
    tokens: dict[int, list[int]] = {rid: [] for rid, _, _ in requests}
    while scheduler.has_work:
        out = scheduler.step()
        for rid, token in zip(out.rids, out.token_ids, strict=True):
            tokens[rid].append(token)
    engine.close()
    return tokens


def sample_into(results: Queue, rank: int, *args: object) -> None:
    """(rank, `sample`'s tokens), put on `results`; then this rank exits as the server's
    followers do."""
    results.put((rank, sample(rank, *args)))  # type: ignore[arg-type]
    results.close()
    results.join_thread()
    exit_now(0)
