from transformers import PreTrainedTokenizerBase

from minisgl.core import FinishReason, Req


class StopChecker:
    """The one place that decides when a request is finished (the detokenizer only trims text)."""

    def __init__(
        self, eos_ids: tuple[int, ...], max_seq_len: int, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer

    def check(self, req: Req) -> tuple[FinishReason, str | int | None] | None:
        """(reason, what matched) if the token just appended finishes `req`, else None."""
        token, params = req.output_ids[-1], req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            return "stop", token
        if params.stop:
            matched = self._match_stop_string(req)
            if matched is not None:
                return "stop", matched
        if (
            len(req.output_ids) >= params.max_tokens
            or len(req.prompt_ids) + len(req.output_ids) >= self.max_seq_len
        ):
            return "length", None
        return None

    def _match_stop_string(self, req: Req) -> str | None:
        assert self.tokenizer is not None, "stop strings need a tokenizer"
        stops = req.params.stop
        # enough tokens to hold the longest stop string even if each char is 4 byte-tokens
        window = 4 * max(len(s) for s in stops) + 8
        # checked after every token, so any match in the tail is one the newest token completed
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return next((stop for stop in stops if stop in tail), None)
