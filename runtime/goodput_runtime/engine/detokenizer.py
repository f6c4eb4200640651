"""Incremental detokenization and stop strings, per request.

Text is handed out a whole character at a time: a token that ends inside a multi-byte character
waits for the next one. When the output ends there anyway (max_tokens, EOS, an abort), the
incomplete bytes come out as U+FFFD, as transformers' `decode` gives them, so the text of a
finished output is always the decode of its tokens (cut before a stop string), streamed or not.

With stop strings, the text held back (what could still grow into one) ends on a token's boundary:
what is handed out is always the whole text of the first ``shown_tokens`` output tokens, so a stream
can report a token's id once its text has been sent, and be taken up from those ids elsewhere.
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
        self.context = len(self.tokens)
        # (length of the text, output tokens read) after each token that completed text, not yet handed out
        self.marks: list[tuple[int, int]] = []
        self.shown_tokens = 0  # output tokens whose whole text has been handed out

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
        self.marks.append((len(self.text), len(self.tokens) - self.context))
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
        if finished:
            end = len(self.text)
            self.shown_tokens = len(self.tokens) - self.context
            self.marks.clear()
        else:
            end = len(self.text) if not self.stop else max(self.emitted, len(self.text) - self.holdback)
            # back to the last token boundary at or before it: a token's text goes out whole
            cut = self.emitted
            while self.marks and self.marks[0][0] <= end:
                cut, self.shown_tokens = self.marks.pop(0)
            end = max(cut, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
