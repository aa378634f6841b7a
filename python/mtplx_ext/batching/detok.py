"""Incremental detokenization and stop strings of one request.

`Detokenizer.push(tokens, final)` returns the newly final text and whether a
stop string ended it. It decodes only the tokens after the newest mark whose
text is already out (and, with stop strings, more than a stop string's
length back), with a few tokens before it as context: decoding the whole
request at every commit costs quadratic time in its length. Text that could
still become a stop string, or that ends in an incomplete UTF-8 sequence, is
held back until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Tokens decoded before an incremental detokenization window, as context.
DETOK_CONTEXT = 4


class Detokenizer:
    """The text of one request's committed tokens, cut at its first stop string.

    Args:
        tokenizer: any object with `decode(ids) -> str`.
        stop: strings that end the text (the first one found is cut, with
            everything after it).

    Attributes:
        tokens: every token pushed so far.
        text: the final text sent so far.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.text = ""
        self._sent = 0  # characters of decoded text already final
        # (token count, characters) where the decoded text ends on a whole
        # character, oldest first.
        self._marks: list[tuple[int, int]] = [(0, 0)]

    def push(self, new: Sequence[int], final: bool) -> tuple[str, bool]:
        """Adds committed tokens; returns (newly final text, whether a stop string ended it).

        Args:
            new: the tokens committed now.
            final: the request ends with them (nothing is held back).
        """
        self.tokens.extend(new)
        decode = self.tokenizer.decode
        longest = max((len(x) for x in self.stop), default=0)
        need = max(0, self._sent - max(longest - 1, 0))  # the first character the stop search reads
        while len(self._marks) > 1 and self._marks[1][1] <= need:
            self._marks.pop(0)
        base_tok, base = self._marks[0]
        ctx = max(0, base_tok - DETOK_CONTEXT)
        head = decode(self.tokens[ctx:base_tok]) if base_tok else ""
        tail = decode(self.tokens[ctx:])
        if not tail.startswith(head):  # context-dependent decoding: the whole text
            base_tok, base, tail, head = 0, 0, decode(self.tokens), ""
            self._marks = [(0, 0)]
        window = tail[len(head):]  # the text from character `base` on
        if not window.endswith("\ufffd"):
            self._marks.append((len(self.tokens), base + len(window)))
        if not final:
            window = window.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its bytes
        cut = False
        end_all = base + len(window)
        if self.stop:
            hits = [i for i in (window.find(x, need - base) for x in self.stop) if i >= 0]
            if hits:
                end_all, cut, final = base + min(hits), True, True
        # Hold back what could still become a stop string.
        hold = 0 if final or not self.stop else longest - 1
        end = max(self._sent, end_all - hold)
        out = window[self._sent - base : end - base]
        self._sent = end
        self.text += out
        return out, cut


__all__ = ["DETOK_CONTEXT", "Detokenizer"]
