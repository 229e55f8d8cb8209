"""How TP ranks stay in lockstep: rank 0 sends each turn's messages to ranks 1..tp-1, which apply
them and run the same step, so every rank adds and aborts the same requests in the same order.

They travel over a gloo group of their own (CPU tensors, whatever the device), encoded as every
other message is (`minisgl.messages`). A group reaches the other machines through the address the
TP group met at: a multi-node run needs no other port, and nothing is bound per rank. An idle
rank 0 sends a turn that is none at each turn of its idle loop (`ping`), which fails once a rank
is gone. While requests wait for their grammars, every rank also combines its flags with the
others' once a turn (`agree`), so that they start the same requests in the same step. At the
start, every rank checks that it was given rank 0's settings (`check_same`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from minisgl.config import ConfigError
from minisgl.messages import (
    AbortRequest,
    AddRequests,
    EndRequests,
    FlushPrefixCache,
    decode,
    encode,
)
from minisgl.utils import init_logger

logger = init_logger(__name__)

Message = AddRequests | AbortRequest | FlushPrefixCache | EndRequests
_PING = -1  # the size of a turn that is none: rank 0 idles (`ping`)
# the other ranks wait for rank 0's next turn for as long as it lives: a server or an offline LLM
# may idle for days
_WAIT_FOREVER = timedelta(days=36500)


class Lockstep:
    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self._group = dist.new_group(backend="gloo", timeout=_WAIT_FOREVER)
        self.leader_gone = False  # set by recv: rank 0 ended without a stop

    def send(self, messages: list[Message] | None) -> None:
        """Rank 0: this turn's messages, or None: the other ranks stop."""
        data = torch.frombuffer(bytearray(encode(messages)), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()]), 0, group=self._group)
        dist.broadcast(data, 0, group=self._group)

    def ping(self) -> None:
        """Rank 0, idle: a turn without a step. It fails once another rank is gone (its connection
        closed), so that a lost node ends the server within an idle turn, not at the next request."""
        try:
            dist.broadcast(torch.tensor([_PING]), 0, group=self._group)
        except RuntimeError as e:
            raise RuntimeError(f"rank 0: another TP rank is gone ({e})") from None

    def check_same(self, settings: dict[str, object]) -> None:
        """Raise ConfigError on every rank unless each was started with rank 0's `settings`: a
        rank whose steps take another shape (a smaller chunk, say) broke the first collective
        they differed in, which killed the server at its first such request."""
        every: list[dict[str, object] | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(every, settings, group=self._group)
        first = every[0]
        assert first is not None
        for rank, theirs in enumerate(every[1:], start=1):
            assert theirs is not None
            if differ := [name for name in first if theirs[name] != first[name]]:
                given = ", ".join(
                    f"{name} {theirs[name]!r} (rank 0: {first[name]!r})" for name in differ
                )
                raise ConfigError(
                    f"TP rank {rank} was started with {given}: start every node alike"
                )

    def agree(self, flags: list[int]) -> list[int]:
        """Every rank's flags combined by their minimum: each rank calls it at the same point of
        the same turn, with as many flags."""
        combined = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(combined, dist.ReduceOp.MIN, group=self._group)
        return combined.tolist()

    def recv(self) -> list[Message] | None:
        """Ranks 1..tp-1: rank 0's next turn; None once rank 0 has stopped, or is gone."""
        size = torch.tensor([_PING])
        try:
            while int(size) == _PING:
                dist.broadcast(size, 0, group=self._group)
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(data, 0, group=self._group)
        except RuntimeError:  # gloo: the connection to rank 0 closed
            logger.warning("rank %d: rank 0 is gone", self.rank)
            self.leader_gone = True
            return None
        return decode(data.numpy().tobytes())
