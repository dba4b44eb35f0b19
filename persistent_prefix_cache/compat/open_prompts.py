"""Which inserts of a server's prompt cache end a request: an admission rule counts one
sighting per request, not one per insert.

mlx-lm 0.32's batched server inserts a request's cache more than once: at the end of
each segment of its prompt (a checkpoint: the system prompt, the prompt but its last
token) and once more when the answer is done (the prompt and the reply). Under
``admit="seen"`` or ``"reuse"`` (`admission`) every insert is a sighting, so a one-off
prompt would be seen twice by its own request and written at first sight. `OpenPrompts`
remembers the prompts fetched and not yet answered: an insert whose tokens stop short of
such a prompt is a checkpoint of it (kept in memory, not a sighting), and the insert
that covers the whole prompt closes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Sequence

OPEN_PROMPTS = 64  # prompts remembered per model: more than a server runs at once


class OpenPrompts:
    """The prompts fetched and not yet answered, per model key (bounded, oldest first out)."""

    def __init__(self, most: int = OPEN_PROMPTS):
        self.most = most
        self._open: dict[Hashable, OrderedDict[int, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def fetched(self, model: Hashable, tokens: Sequence[int]) -> None:
        """A request for `tokens` began (its prompt cache was asked for)."""
        with self._lock:
            prompts = self._open.setdefault(model, OrderedDict())
            self._next += 1
            prompts[self._next] = tuple(tokens)
            while len(prompts) > self.most:
                prompts.popitem(last=False)

    def checkpoint(self, model: Hashable, tokens: Sequence[int]) -> bool:
        """Whether an insert of `tokens` is a checkpoint inside an open request (its
        tokens a strict prefix of a prompt fetched and not answered yet); an insert that
        covers a whole open prompt answers it (it is forgotten) and is no checkpoint."""
        n, toks = len(tokens), tuple(tokens)
        with self._lock:
            prompts = self._open.get(model)
            if not prompts or n == 0:
                return False
            for at, prompt in reversed(prompts.items()):  # the newest request first
                m = len(prompt)
                if n < m and prompt[n - 1] == toks[n - 1] and prompt[:n] == toks:
                    return True
                if n >= m and m and toks[m - 1] == prompt[-1] and toks[:m] == prompt:
                    del prompts[at]
                    return False
        return False
