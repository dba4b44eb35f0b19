"""Tiers around the disk store: the RAM tier of recently used blocks (`memory`) and the
remote tier shared by every host through a Redis / Valkey server (`remote*`)."""
