"""IncrementalDetokenizer: one sample's output text, built token by token, and its stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from vbatch.client.tokenizer import TextTokenizer
from vbatch.sampling_params import SamplingParams

# NOTE: how many of the prompt's last tokens the text is decoded after, so that a decoder that
# treats the text's first token apart (SentencePiece's Strip of a leading space) does not; up
# to MAX_PROMPT_CONTEXT while that suffix starts inside a character.
PROMPT_CONTEXT = 6
MAX_PROMPT_CONTEXT = 24
REPLACEMENT = "\ufffd"


def prompt_context(tokenizer: TextTokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt's last tokens the output is decoded after: PROMPT_CONTEXT of them, more where
    their text starts with a split character, the whole prompt where it is that short."""
    ids = list(prompt_token_ids)
    for size in range(PROMPT_CONTEXT, min(len(ids), MAX_PROMPT_CONTEXT) + 1):
        suffix = ids[-size:]
        if not tokenizer.backend.decode(suffix, skip_special_tokens=False).startswith(REPLACEMENT):
            return suffix
    return ids[-MAX_PROMPT_CONTEXT:]


class IncrementalDetokenizer:
    """Turns a sample's output token ids into text as they arrive and watches for stop strings.

    Invariants: `text` is what `token_ids` add to the text of the prompt's last tokens
    (`prompt_context`), as vLLM decodes it: `decode(context + token_ids)` past the text of the
    context's tokens up to a character the prompt left unfinished (the output's text begins
    with the text of that character's tokens), minus any bytes of a still-unfinished
    character, cut at the stop-string match that ends first (the longest one among those ending
    together); after a finish on EOS or a stop token id, the same of `token_ids[:-1]` (see
    `finalize`). For a byte-level tokenizer (GPT-2's, Llama 3's, SmolLM2's) and a prompt of
    whole characters that is `decode(token_ids)`; a SentencePiece one keeps the first token's
    leading space.
    Once a stop string is hit, `token_ids` ends with the token that completed it, `stop_str` is
    set, and later tokens are ignored. As in vLLM, a stop string must end in the text of a token
    after the first `min_tokens`.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = params.skip_special_tokens
        self._context = prompt_context(tokenizer, prompt_token_ids)
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        # NOTE: the stream holds back the tokens of a character the prompt left unfinished; the
        # output's text starts after the last context token it gave text for.
        num_decoded = 0
        for i, token_id in enumerate(self._context):
            if self._stream.step(self._backend, token_id) is not None:
                num_decoded = i + 1
        self._context_text = self._backend.decode(
            self._context[:num_decoded], skip_special_tokens=self._skip_special_tokens
        )
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
            self._chunks = [self._decoded(self._token_ids[:-1])]
            return None
        if self._num_pending_tokens == 0:
            return None
        text = self.text
        full = self._decoded(self._token_ids)
        assert full.startswith(text), "incremental text diverged from the full decode"
        if self._append(full[len(text) :]):
            return self.stop_str
        return None

    def _decoded(self, token_ids: list[int]) -> str:
        """The text `token_ids` add after the prompt's context (see the class invariants)."""
        full = self._backend.decode(
            self._context + token_ids, skip_special_tokens=self._skip_special_tokens
        )
        if full.startswith(self._context_text):
            return full[len(self._context_text) :]
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

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
