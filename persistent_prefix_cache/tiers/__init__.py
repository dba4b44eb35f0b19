"""Tiers in front of the disk store: the RAM tier of recently used blocks."""
