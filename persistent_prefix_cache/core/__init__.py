"""The core wing: what one fetch and one store do between the facade and the storage.

The lookup, the cost cut, the restore, damage and timing of a fetch (`fetching`); the blocks a
store cuts and the writer thread that commits them (`storing`, `writeback`); warm and remote
fills; the cost model as a public object (`cost_model`); the handle's parts and how they are
opened (`parts`, `opening`). Only the facade (`store`), `prefill`, and the wings above (admin,
compat, cli) import it.
"""
