"""Incremental detokenization and stop strings, per request.

Text is handed out a whole character at a time: a token that ends inside a multi-byte character
waits for the next one. When the output ends there anyway (max_tokens, EOS, an abort), the
incomplete bytes come out as U+FFFD, as transformers' `decode` gives them, so the text of a
finished output is always the decode of its tokens (cut before a stop string), streamed or not.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.tokens = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text so far, cut before a stop string once one is found
        self.emitted = 0
        self.stopped = False  # a stop string was found: nothing after it is text

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one token; True when the text now contains a stop string (looked for only with
        check_stop: a request's first min_tokens tokens cannot stop it)."""
        self.tokens.append(token_id)
        return self._read(check_stop, final=False)

    def flush(self, check_stop: bool = True) -> bool:
        """The output has ended: text still held for an incomplete character comes out, its bytes as
        U+FFFD. True when that completes a stop string."""
        if self.stopped:
            return False
        return self._read(check_stop, final=True)

    def _read(self, check_stop: bool, final: bool) -> bool:
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.tokens[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return False  # an incomplete character: wait for the next token
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if not check_stop:
            return False
        for s in self.stop:
            at = self.text.find(s, searched_from)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                return True
        return False

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back what could still grow into a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
