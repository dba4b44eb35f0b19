"""mlx-lm's cache classes: the only package that names them or relies on their ``state``.

`adapters` turns one cache layer into the tensors of one block and back, per class;
`layout` applies them to a model's whole layout (cutting caches into blocks, deciding
where a path of blocks can be resumed, rebuilding fresh caches); `cache_ops` holds the
few operations on whole cache lists the compat layers and the CLI need; `recompute`
checks a cache against the model by computing some of it again. The store, the
read path and the compat layers see cache layers only through these names.
"""

from .adapters import (
    SEQ,
    STATE,
    WINDOW,
    BlockSource,
    BlockView,
    JoinedSource,
    ViewPath,
    adapter_for,
    cache_length,
    grown_rows,
    leaves,
    model_cache,
    rebuild_cache,
    signature_of,
    template_cache,
)
from .cache_ops import (
    all_sliced,
    can_trim,
    copy_prefix,
    empty_like,
    frozen,
    kv_quantization,
    layer_from_seed,
    offset_trimmable,
    seed_without_batch_axis,
    trim,
    without_batch_axis,
)
from .layout import Layout, cut_block

__all__ = [
    "SEQ",
    "STATE",
    "WINDOW",
    "BlockSource",
    "BlockView",
    "JoinedSource",
    "Layout",
    "ViewPath",
    "adapter_for",
    "all_sliced",
    "cache_length",
    "can_trim",
    "copy_prefix",
    "cut_block",
    "empty_like",
    "frozen",
    "grown_rows",
    "kv_quantization",
    "layer_from_seed",
    "leaves",
    "model_cache",
    "offset_trimmable",
    "rebuild_cache",
    "seed_without_batch_axis",
    "signature_of",
    "template_cache",
    "trim",
    "without_batch_axis",
]
