"""Which tier served a restore: block counts from two `stats()` of one handle, and in words.

`ppc generate`, `ppc serve` and `PersistentLRUPromptCache` say where a prompt's blocks came from
(the RAM tier, the segment files, the fleet's remote) by comparing the handle's counters
before and after the fetch.
"""


def blocks_by_tier(before: dict, after: dict) -> dict[str, int]:
    """The blocks restores took from each tier between two `stats()` of one handle:
    ``ram`` (stored by the handle, or admitted from a disk read), ``disk`` (read from
    segment files) and ``remote`` (read from the fleet's server)."""

    def grew(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    return {
        "ram": grew("memory_hits_store") + grew("memory_hits_disk"),
        "disk": grew("restored_blocks_disk"),
        "remote": grew("memory_hits_remote"),
    }


def describe_tiers(tiers: dict[str, int]) -> str:
    """``blocks_by_tier`` in words: ``"RAM 3, disk 2 blocks"`` (tiers that served none left out)."""
    names = {"ram": "RAM", "disk": "disk", "remote": "remote"}
    served = [f"{names[t]} {n}" for t, n in tiers.items() if n]
    return (", ".join(served) + " blocks") if served else "-"


def describe_decisions(stats: dict) -> str:
    """A store's fetch decisions from its `stats()`, in words: how many fetches hit or
    missed, and of the hits how many restored all, only the RAM tier's part, a shorter
    prefix, or nothing (skipped as slower than recomputing), damaged blocks met, and the
    costs that decided (the prefill's rate and a forward call's cost, each tier's rate and
    fixed cost)."""

    def rate(value, unit: str, scale: float) -> str:
        return "?" if value is None else f"{value / scale:,.1f} {unit}"

    tiers = [
        f"{tier} {rate(stats.get(f'restore_bytes_per_s_{tier}'), 'GB/s', 1e9)} "
        f"+ {rate(stats.get(f'restore_fixed_s_{tier}'), 'ms', 1e-3)}"
        for tier in ("ram", "disk")
    ]
    return (
        f"{stats['queries']} fetches, {stats['hits']} hits, {stats['misses']} misses; "
        f"restored all {stats['restored_all']}, RAM only {stats['restored_ram_only']}, "
        f"shorter {stats['restored_shorter']}, skipped as slower {stats['skipped_slower']}; "
        f"damaged {stats['corrupt']}; costs: prefill {rate(stats.get('prefill_tokens_per_s'), 'tokens/s', 1)} "
        f"(a call {rate(stats.get('prefill_per_forward_s'), 'ms', 1e-3)}), " + ", ".join(tiers)
    )
