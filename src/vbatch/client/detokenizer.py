"""IncrementalDetokenizer: one sample's output text, built token by token, and its stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from vbatch.client.tokenizer import TextTokenizer
from vbatch.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns a sample's output token ids into text as they arrive and watches for stop strings.

    Invariants: `text` is `decode(token_ids)` minus any bytes of a still-unfinished character,
    cut at the stop-string match that ends first (the longest one among those ending together);
    after a finish on EOS or a stop token id, `decode(token_ids[:-1])` (see `finalize`).
    Once a stop string is hit, `token_ids` ends with the token that completed it, `stop_str` is
    set, and later tokens are ignored. As in vLLM, a stop string must end in the text of a token
    after the first `min_tokens`.
    """

    def __init__(self, tokenizer: TextTokenizer, params: SamplingParams) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._skip_special_tokens = params.skip_special_tokens
        self._skipped_ids = (
            tokenizer.special_token_ids if params.skip_special_tokens else frozenset()
        )
        self._stops = tuple(params.stop)
        self._max_lookback = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._chunks: list[str] = []
        # NOTE: the last `_max_lookback` chars of text, so a stop string split over tokens is found.
        self._tail = ""
        self._num_pending_tokens = 0
        self._is_finalized = False
        self._token_ids: list[int] = []
        self.stop_str: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string if one was completed (the caller aborts).

        `stop_terminated`: the core ended the sample on the last of these tokens (EOS or a stop
        token id). As in vLLM, that token's text is not checked for stop strings unless
        include_stop_str_in_output, so the finish keeps its own stop_reason."""
        assert not self._is_finalized, "update() after finalize()"
        if self.stop_str is not None:
            return None
        if stop_terminated and not self._include_stop and new_token_ids:
            hit = self.update(new_token_ids[:-1])
            if hit is None:
                self._token_ids.append(new_token_ids[-1])
            return hit
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                if token_id not in self._skipped_ids:
                    self._num_pending_tokens += 1
                continue
            self._num_pending_tokens = 0
            if self._append(chunk):
                return self.stop_str
        return None

    def finalize(self, stopped_on_token: bool = False) -> str | None:
        """Flush bytes held back for an unfinished character; return a stop string this hits.

        `stopped_on_token`: the core ended the sample on EOS or a stop token id. As in vLLM, that
        token stays in `token_ids` but its text is left out of `text`, unless
        include_stop_str_in_output (a skipped special token has none anyway)."""
        if self._is_finalized or self.stop_str is not None:
            self._is_finalized = True
            return None
        self._is_finalized = True
        last = self._token_ids[-1] if self._token_ids else None
        if (
            stopped_on_token
            and not self._include_stop
            and last is not None
            and last not in self._skipped_ids
        ):
            self._chunks = [
                self._backend.decode(
                    self._token_ids[:-1], skip_special_tokens=self._skip_special_tokens
                )
            ]
            return None
        if self._num_pending_tokens == 0:
            return None
        text = self.text
        full = self._backend.decode(self._token_ids, skip_special_tokens=self._skip_special_tokens)
        assert full.startswith(text), "incremental text diverged from the full decode"
        if self._append(full[len(text) :]):
            return self.stop_str
        return None

    def _append(self, chunk: str) -> bool:
        """Add decoded text; on a stop-string match cut the text there and return True."""
        if not chunk:
            return False
        tail = self._tail
        match: tuple[int, int, str] | None = None  # (end, start, stop) in `tail + chunk`
        if self._stops and len(self._token_ids) > self._min_tokens:
            window = tail + chunk
            for stop in self._stops:
                # NOTE: only matches that end inside `chunk` are new; earlier ones were checked.
                start = window.find(stop, max(0, len(tail) - len(stop) + 1))
                if start >= 0:
                    found = (start + len(stop), start, stop)
                    match = found if match is None else min(match, found)
        if match is None:
            self._chunks.append(chunk)
            if self._max_lookback:
                self._tail = (tail + chunk)[-self._max_lookback :]
            return False
        end, start, stop = match
        # NOTE: cut < 0 when the stop string began in text already emitted.
        cut = (end if self._include_stop else start) - len(tail)
        if cut >= 0:
            self._chunks.append(chunk[:cut])
        else:
            self._chunks = [self.text[:cut]]
        self.stop_str = stop
        return True
