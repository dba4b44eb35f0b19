"""Which new blocks a `store()` writes: the admission rule (``store(..., admit=)``).

Every block written costs SSD wear; a block never read back is wear for nothing. A
server sees many prompts only once (a question asked once, after a shared system
prompt), and writing them all is most of what it writes (docs/wear.md measures it on a
trace). The rules, by the `store()` argument ``admit``:

- ``"always"``: every new block is written (the default of `store()`: a caller who
  stores a prompt asked for it; ``ppc precompute`` and `prefill` store what they compute).
- ``"seen"``: a block is written at its second sighting only: the blocks of a prompt
  (a prefix of it) seen before by a store of this handle, in a window of `SEEN_KEYS`
  to twice as many block keys, and the block that prefix ends in (where a repeated
  prompt's tail lies, before another reply). What a repeated prompt and a prefix
  shared by several prompts (a system prompt) need; a one-off prompt's blocks are
  only remembered (their keys), never written.
- ``"reuse"``: ``"seen"``, and a prompt that continues where an earlier ``"reuse"`` store
  ended (a chat's next turn, an agent's next step: that store's tokens and more) is
  written whole at first sight: such a prompt's blocks are read back by its next turn,
  and after a reboot. The tokens of a ``"reuse"`` store are taken for a request's end
  (prompt and reply); a store of a checkpoint inside a request (``mlx_lm.server``'s
  system-prompt segment) should say ``"seen"``, or every request after it would look
  like a continuation.

The memory: one `key_filter.KeyFilter` per handle (`SEEN_BITS` bits per generation,
1 MiB in all), holding the keys of blocks seen and not written, and where each
``"reuse"`` store ended (a tag of its last full block's key: `end_key`). A false yes
(rare) writes a block the rule would have deferred, as ``"always"`` does; nothing is
ever lost that the store holds. Nothing of it is written to disk: after a restart the
first sighting of a prompt counts again (a chat continued after a reboot is written
from its second turn on; the server's in-memory cache holds the first).

A layout with a layer that is not sliced along the tokens (a recurrent state, a
rotating window) keeps a snapshot only at the end of what it stores: such a prompt is
written whole or not at all (whole when all its blocks are admitted).
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from ..key_filter import KeyFilter
from ..keys import block_key

ADMIT_RULES = ("always", "seen", "reuse")
SEEN_BITS = 1 << 22  # bits per generation of the filter: 512 KiB
SEEN_KEYS = 1 << 18  # keys per generation: 262,144 (16 bits per key: ~0.24 % false yes)


def check_rule(admit: object) -> str:
    """`admit` if it names a rule of `ADMIT_RULES`.

    Raises:
        InvalidArgumentError: Otherwise (one line naming the rules).
    """
    if not isinstance(admit, str) or admit not in ADMIT_RULES:
        raise InvalidArgumentError(f"admit must be one of {', '.join(map(repr, ADMIT_RULES))}, got {admit!r}")
    return admit


def end_key(last_full: bytes) -> bytes:
    """The filter's tag for "a store ended in the block after `last_full`" (its last full
    block's key, or the root): three bytes hashed after it, never a block of int32 tokens."""
    return block_key(last_full, b"end")


class Admission:
    """The admission rule of one handle's stores (see the module's docstring).

    Args:
        root: The model's root key (the parent of a chain's first block).
        block_size: Tokens per full block.
    """

    def __init__(self, root: bytes, block_size: int):
        self.root, self.block_size = root, block_size
        self.seen = KeyFilter(bits=SEEN_BITS, generation=SEEN_KEYS)

    def admitted(self, keys: list[bytes], n_tokens: int, stored: int, rule: str, *, whole_only: bool) -> int:
        """How many leading blocks of a prompt may be stored (the first `stored` already are).

        Args:
            keys: The prompt's chain of block keys (the last one possibly partial).
            n_tokens: The prompt's tokens.
            stored: How many leading blocks the store holds already.
            rule: One of `ADMIT_RULES`.
            whole_only: The layout resumes only at the end of what is stored: admit
                all of `keys` or none of the new blocks.

        Returns:
            The number of leading blocks to store (between `stored` and ``len(keys)``);
            the keys of those left out are remembered as seen.
        """
        if rule == "always":
            return len(keys)
        if stored >= len(keys):  # all stored: where this store ended is still worth knowing
            if rule == "reuse":
                self.seen.add([self._end(keys, n_tokens)])
            return len(keys)
        known = stored
        while known < len(keys) and self.seen.holds(keys[known]):
            known += 1
        # A prefix seen before is written with the block it ends in: a prompt seen again with
        # another reply (or a system prompt with another question) ends inside that block,
        # which a fetch of it then restores (a stored block whose tokens start with its tail).
        upto = known + 1 if stored < known < len(keys) else known
        if rule == "reuse":
            if known < len(keys) and self._continues(keys, stored, known):
                upto = len(keys)
            self.seen.add([self._end(keys, n_tokens)])
        if whole_only and upto < len(keys):
            upto = stored
        if upto < len(keys):
            self.seen.add(keys[upto:])
        return upto

    def left_out(self, key: bytes) -> bool:
        """Whether a store of this handle left the block `key` out (rarely a false yes; a
        block stored since is found before this is asked)."""
        return self.seen.holds(key)

    def _end(self, keys: list[bytes], n_tokens: int) -> bytes:
        """The tag of where a store of `n_tokens` ends: after its last full block."""
        full = n_tokens // self.block_size
        return end_key(keys[full - 1] if full else self.root)

    def _continues(self, keys: list[bytes], stored: int, known: int) -> bool:
        """Whether an earlier ``"reuse"`` store ended on the stored or seen part of the
        prompt, at or after its stored part: this prompt is that one's next turn."""
        for j in range(known, stored - 1, -1):
            if self.seen.holds(end_key(keys[j - 1] if j else self.root)):
                return True
        return False
