from minisgl.core import FinishReason, Req


class StopChecker:
    """Decides when the tokens a request got finish it: an eos or stop token, max_tokens, the end
    of the context. Stop strings are matched on the text, where it is decoded (the detokenizer's
    `IncrementalDetokenizer`), which then aborts the request here."""

    def __init__(self, eos_ids: tuple[int, ...], max_seq_len: int) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.max_seq_len = max_seq_len

    def check(self, req: Req) -> tuple[FinishReason, int | None] | None:
        """(reason, the stop token) if the token just appended finishes `req`, else None."""
        token, params = req.token_ids[-1], req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            return "stop", token
        if req.num_output_tokens >= params.max_tokens or len(req.token_ids) >= self.max_seq_len:
            return "length", None
        return None
