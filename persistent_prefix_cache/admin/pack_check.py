"""Checking a pack's blocks against the model before an import commits them (``ppc import --model M``).

A pack no key of the import signed (another store's, an unsigned or older one) proves
itself against the model: its models must be this model (the fingerprint recomputed
from the loaded weights, the root key recomputed from it, the layout the model builds),
and chains of its blocks, sampled at random (`chains`; every one if None), are rebuilt
into caches and checked by `layers.recompute.check_cache` (spans computed again from the
chain's own prefix). Blocks on no sampled chain are not checked: a pack from a source
you do not trust is checked whole with every chain.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np

from ..blocks import Node
from ..device.buffers import HostBits
from ..errors import InvalidArgumentError
from ..keys import root_key
from ..layers import BlockSource, Layout, kv_quantization, signature_of
from ..layers.mlx_lm_versions import layout_variant
from ..layers.recompute import DEFAULT_SPANS, check_cache
from ..weights_hash import fingerprint_model, scheme_of
from .packs import Check, PackBlocks


def model_check(model: Any, *, chains: int | None, spans: int = DEFAULT_SPANS) -> Check:
    """A `packs.import_pack` check that holds a pack's blocks against `model`.

    Args:
        model: The loaded mlx-lm model.
        chains: How many chains to check, sampled at random (None: every one).
        spans: Spans per chain computed again (see `check_cache`).

    Returns:
        The check: called with the blocks to commit, it returns what it checked
        (``chains``, ``of``, ``blocks``, ``difference``, ``tolerance``) or raises
        `InvalidArgumentError` naming the first chain or model that is not `model`'s.
    """
    fingerprints: dict[str, str] = {}

    def fingerprint(scheme: str) -> str:
        if scheme not in fingerprints:
            fingerprints[scheme] = fingerprint_model(model, scheme=scheme)
        return fingerprints[scheme]

    def check(blocks: PackBlocks) -> dict:
        if not blocks.nodes:  # every block is here already: nothing to commit, nothing to check
            return {"chains": 0, "of": 0, "blocks": 0, "difference": 0.0, "tolerance": 0.0}
        roots = _roots(blocks)
        layouts: dict[bytes, Layout] = {}  # (none for a model that is not `model`)
        for root in set(roots.values()):
            desc = blocks.models.get(root) or _stored_model(blocks, root)
            layout = _layout_of(model, root, desc, fingerprint)
            if layout is not None:
                layouts[root] = layout
        foreign = [k for k, r in roots.items() if layouts.get(r) is None]
        if foreign or len(roots) < len(blocks.nodes):
            n = len(foreign) + len(blocks.nodes) - len(roots)
            raise InvalidArgumentError(
                f"{blocks.path}: {n:,} of its {len(blocks.nodes):,} new blocks are not of --model's model (another "
                "model's fingerprint or KV layout, a root key that does not follow from them, or a chain that "
                "reaches no model): they cannot be checked against it",
                hint="nothing was written; export one model's part (ppc export --model), or pass --trust",
            )
        parents = {n.parent for n in blocks.nodes.values()}
        ends = sorted((n for n in blocks.nodes.values() if n.resumable and n.key not in parents), key=lambda n: n.key)
        if not ends:
            raise InvalidArgumentError(f"{blocks.path}: none of its new blocks ends a chain a cache can be rebuilt at",
                                       hint="nothing was written; pass --trust to import it unchecked")  # fmt: skip
        picked = ends if chains is None or chains >= len(ends) else random.SystemRandom().sample(ends, chains)
        covered: set[bytes] = set()
        worst, tolerance = 0.0, 0.0
        for end in picked:
            path = _path(blocks, end)
            covered.update(n.key for n in path if n.key in blocks.nodes)
            tokens = np.frombuffer(b"".join(n.tokens for n in path), dtype="<i4").tolist()
            cache = _rebuild(blocks, layouts[roots[end.key]], path)
            checked = check_cache(model, tokens, cache, block_size=blocks.index.block_size, spans=spans)
            if not checked.passed:
                raise InvalidArgumentError(
                    f"{blocks.path}: the chain ending in block {end.key.hex()[:16]} ({end.end:,} tokens) is not the "
                    f"model's KV of its tokens: computed again from its own prefix, {checked.where} differs by "
                    f"{checked.error:.2g} (the right tokens and model stay within {checked.tolerance:g})",
                    hint="nothing was written; this pack's KV does not belong to its prompts or to this model",
                )
            worst, tolerance = max(worst, checked.error), max(tolerance, checked.tolerance)
        return {"chains": len(picked), "of": len(ends), "blocks": len(covered), "difference": worst,
                "tolerance": tolerance}  # fmt: skip

    return check


def _stored_model(blocks: PackBlocks, root: bytes) -> dict | None:
    with blocks.index.reader() as reader:
        raw = reader.model(root)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _layout_of(model: Any, root: bytes, desc: dict | None, fingerprint) -> Layout | None:
    """The layout `model` stores under `root`, if `desc` describes `model` there (its
    fingerprint recomputed, the root key recomputed from it); else None."""
    if not isinstance(desc, dict):
        return None
    fp, namespace, layout = desc.get("fingerprint"), desc.get("namespace"), desc.get("layout")
    if not (isinstance(fp, str) and isinstance(namespace, str) and isinstance(layout, str)):
        return None
    scheme = scheme_of(fp)
    if scheme is None or fingerprint(scheme) != fp or root_key(fp, namespace, layout + layout_variant()) != root:
        return None
    quant = kv_quantization(layout)
    bits, group = quant if quant is not None else (None, 64)
    found = Layout.of_model(model, kv_bits=bits, kv_group_size=group, variant=layout_variant())
    return found if signature_of(found.template) == layout else None


def _roots(blocks: PackBlocks) -> dict[bytes, bytes]:
    """Block key -> its model's root key, for every new block whose chain reaches one."""
    out: dict[bytes, bytes] = {}
    for key in blocks.nodes:
        trail: list[bytes] = []
        node: Node | None = blocks.nodes[key]
        while node is not None and node.key not in out and node.position > 0:
            trail.append(node.key)
            parent = blocks.node(node.parent)
            node = parent if parent is not None and parent.end == node.position else None
        if node is None:
            continue
        root = out[node.key] if node.key in out else node.parent
        out.update(dict.fromkeys(trail + [node.key], root))
    return {k: r for k, r in out.items() if k in blocks.nodes}


def _path(blocks: PackBlocks, end) -> list:
    path = [end]
    while path[-1].position > 0:
        path.append(blocks.node(path[-1].parent))
    return path[::-1]


def _rebuild(blocks: PackBlocks, layout: Layout, path: list) -> list:
    """The cache a chain of blocks stands for, rebuilt as a restore does."""
    views: dict[str, list] = {lid: [] for lid in layout.kinds}
    for node in path:
        tensors = blocks.tensors(node)
        if tensors is None:
            raise InvalidArgumentError(f"{blocks.path}: block {node.key.hex()} is damaged")
        for lid in views:
            part = {fld: HostBits(bits, dtype).to_mx() for fld, (bits, dtype) in tensors.get(lid, {}).items()}
            views[lid].append(Layout.view(node, lid, part))
    cache = layout.rebuild({lid: BlockSource(v) for lid, v in views.items()}, path[-1].end)
    if cache is None:
        raise InvalidArgumentError(
            f"{blocks.path}: the blocks ending in {path[-1].key.hex()} do not fit the model's layout"
        )
    return cache
