"""The import path of `PersistentLRUPromptCache` (see `compat.lru_prompt_cache`)."""

from .compat.lru_prompt_cache import PersistentLRUPromptCache

__all__ = ["PersistentLRUPromptCache"]
