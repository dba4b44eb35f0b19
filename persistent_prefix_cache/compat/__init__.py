"""Drop-ins for other projects' APIs, built on the store's public names only.

- `prefix_cache`, `block_aware`, `paged_cache`: the API of ``vllm_mlx.prefix_cache`` and
  ``vllm_mlx.paged_cache`` (the seed this project grew from).
- `lru_prompt_cache`: mlx-lm's ``LRUPromptCache`` with a store behind it.
- `server_patch`: how ``ppc serve`` puts that class into ``mlx_lm.server``.
- `through`: the read-through / write-through link they share.
"""
