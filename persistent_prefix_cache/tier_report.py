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
