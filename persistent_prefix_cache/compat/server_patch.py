"""How ``ppc serve`` gives ``mlx_lm.server`` a persistent prompt cache.

``mlx_lm.server.main`` parses its options and calls the module's ``run(host, port,
model_provider)``, which builds ``LRUPromptCache(prompt_cache_size)`` and hands it to
the ``ResponseGenerator``. `patched_server` replaces two names in the ``mlx_lm.server``
module while the server runs: ``run`` by a wrapper that notes the ``ModelProvider`` and
calls the original, and ``LRUPromptCache`` by a factory of our class (and a third where
the server has it: ``scan_cache_dir``, which ``GET /v1/models`` calls, answers "no
downloaded models" where there is no Hugging Face cache yet, instead of an exception
whose traceback fills the log: `scan_hub_cache`); and one method of the server's handler
class, ``APIHandler.do_GET``, by one that answers ``GET /metrics`` (`serve_metrics`:
Prometheus' text format, docs/serve.md#metrics) and hands every other path to the
original. The server keys
caches by ``model_provider.model_key`` and loads one model at a time; `ProviderStores`
opens one store handle per model key (all in one directory, told apart by each model's
fingerprint) from the model the provider has loaded. Nothing else in mlx-lm is touched,
and every name is put back when the server returns.

With ``--draft-model`` the store holds the model's and the draft's layers together
under a fingerprint of both. With ``--adapter-path`` the weights are hashed at every
start (an adapter changes the KV without changing the model folder the hash is
remembered by).

Checked against the source of mlx-lm 0.31.3, 0.32.0, 0.32.1 and 0.32.2 (tested on
0.31.3 and 0.32.2: the two names, ``run``'s parameters, ``LRUPromptCache``'s methods and
``APIHandler.do_GET`` are the same in both; docs/versions.md). Versions up to 0.31.1 defined a different
``LRUPromptCache`` (no ``cache_type``); `check_server` refuses any server whose structure
differs from what the patch relies on, with a message, instead of running uncached.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, cast

from ..errors import UnsupportedServerError
from ..fingerprint import fingerprint_model
from ..layers import model_cache
from ..metrics import CONTENT_TYPE, exposition, server_metrics
from ..store import PersistentPrefixCache
from .tenants import Refused, RequestTenants, Tenant, Tenants, tenant_batches, tenant_responses

log = logging.getLogger("persistent_prefix_cache.serve")

CHECKED_MLX_LM_VERSIONS = ("0.31.3", "0.32.0", "0.32.1", "0.32.2")
_CACHE_METHODS = ("fetch_nearest_cache", "insert_cache", "trim_to", "stats_by_type")


def check_server(server: Any) -> None:
    """Verify that `server` (the ``mlx_lm.server`` module) has the structure we patch.

    Args:
        server: The imported ``mlx_lm.server`` module.

    Raises:
        UnsupportedServerError: Naming what differs, the installed mlx-lm version and
            the checked ones.
    """
    problems = []
    for name in ("main", "run", "LRUPromptCache", "ModelProvider", "ResponseGenerator", "APIHandler"):
        if not hasattr(server, name):
            problems.append(f"mlx_lm.server has no {name}")
    if not problems and not callable(getattr(server.APIHandler, "do_GET", None)):
        problems.append("its APIHandler has no do_GET")
    if not problems:
        cls = server.LRUPromptCache
        # Our class extends mlx_lm.models.cache.LRUPromptCache: it must be the server's.
        if _mlx_lm_lru_class() is not cls:
            problems.append("its LRUPromptCache is not mlx_lm.models.cache.LRUPromptCache")
        missing = [m for m in _CACHE_METHODS if not callable(getattr(cls, m, None))]
        if missing:
            problems.append(f"LRUPromptCache lacks {', '.join(missing)}")
        elif "cache_type" not in inspect.signature(cls.insert_cache).parameters:
            problems.append("LRUPromptCache.insert_cache takes no cache_type")
        if not isinstance(getattr(cls, "nbytes", None), property):
            problems.append("LRUPromptCache.nbytes is not a property")
        params = list(inspect.signature(server.run).parameters)
        if params[:3] != ["host", "port", "model_provider"]:
            problems.append(f"run() takes {params}, not (host, port, model_provider, ...)")
        # Both names are looked up as module globals at call time: that is what we patch.
        if "LRUPromptCache" not in _global_names(server.run):
            problems.append("run() does not build the LRUPromptCache")
        if "run" not in _global_names(server.main):
            problems.append("main() does not call run()")
    if problems:
        raise UnsupportedServerError(
            f"ppc serve cannot patch mlx_lm.server of mlx-lm {_mlx_lm_version()}: "
            + "; ".join(problems)
            + f". It was checked with mlx-lm {', '.join(CHECKED_MLX_LM_VERSIONS)}: install one "
            f"of those (pip install 'mlx-lm=={CHECKED_MLX_LM_VERSIONS[-1]}'), or run "
            "mlx_lm.server without a persistent cache",
            hint="",
        )


def _mlx_lm_lru_class() -> type | None:
    """``mlx_lm.models.cache.LRUPromptCache`` (None in an mlx-lm without it)."""
    try:
        from mlx_lm.models.cache import LRUPromptCache
    except ImportError:
        return None
    return LRUPromptCache


def _global_names(fn: Callable) -> set[str]:
    return set(fn.__code__.co_names)


def _mlx_lm_version() -> str:
    try:
        from mlx_lm import __version__

        return __version__
    except ImportError:
        return "(unknown version)"


def check_tenant_server(server: Any) -> None:
    """Verify that `server` has what ``ppc serve --tenants`` also relies on: its handler's
    ``do_POST``, ``ResponseGenerator.generate`` and a ``BatchGenerator`` whose
    ``insert_segments``, ``extract_cache`` and ``next`` tell requests apart (`compat.tenants`).

    Raises:
        UnsupportedServerError: Naming what differs.
    """
    problems = [f"mlx_lm.server has no {name}" for name in ("BatchGenerator",) if not hasattr(server, name)]
    for owner, names in (
        ("APIHandler", ("do_POST",)),
        ("ResponseGenerator", ("generate",)),
        ("BatchGenerator", ("insert_segments", "extract_cache", "next", "remove")),
    ):
        cls = getattr(server, owner, None)
        problems += [
            f"its {owner} has no {n}" for n in names if cls is not None and not callable(getattr(cls, n, None))
        ]
    if problems:
        raise UnsupportedServerError(
            f"ppc serve --tenants cannot tell requests apart in mlx_lm.server of mlx-lm {_mlx_lm_version()}: "
            + "; ".join(problems) + f". It was checked with mlx-lm {CHECKED_MLX_LM_VERSIONS[-1]}",
            hint="",
        )  # fmt: skip


@contextmanager
def patched_server(
    server: Any,
    make_cache: Callable[[Any, int, int], Any],
    *,
    tenants: Tenants | None = None,
    carried: RequestTenants | None = None,
) -> Iterator[dict[str, Any]]:
    """Make ``server.run`` build its prompt cache with `make_cache` while inside.

    Args:
        server: The ``mlx_lm.server`` module (checked with `check_server` first).
        make_cache: ``make_cache(model_provider, max_size, max_bytes)`` returning the
            object the server uses as its prompt cache.
        tenants: Serve tenants (`compat.tenants`; checked with `check_tenant_server`):
            every POST names its tenant by its API key or the proxy's header, or is
            refused (401); None: one namespace for every request.
        carried: What carries each request's tenant to its fetch and inserts (the prompt
            cache `make_cache` builds reads it); needed with `tenants`.

    Yields:
        A dict that gets ``"provider"`` and ``"cache"`` once the server has built them.
    """
    original_run, original_cache_class = server.run, server.LRUPromptCache
    original_scan = getattr(server, "scan_cache_dir", None)
    handler_class = server.APIHandler
    original_get, original_post = handler_class.do_GET, handler_class.do_POST
    original_responses, original_batches = server.ResponseGenerator, getattr(server, "BatchGenerator", None)
    built: dict[str, Any] = {}

    def do_post(handler):
        assert tenants is not None and carried is not None
        try:
            tenant = tenants.tenant(handler.headers)
        except Refused as exc:
            refuse(handler, str(exc))
            return
        with carried.handling(tenant):
            original_post(handler)

    def do_get(handler):
        if handler.path.split("?", 1)[0] == "/metrics":
            serve_metrics(handler, built.get("cache"))
        else:
            original_get(handler)

    def run_noting_provider(host, port, model_provider, *args, **kwargs):
        built["provider"] = model_provider
        return original_run(host, port, model_provider, *args, **kwargs)

    def build_prompt_cache(max_size: int = 10, max_bytes: int = 1 << 63):
        built["cache"] = make_cache(built.get("provider"), max_size, max_bytes)
        return built["cache"]

    server.run, server.LRUPromptCache = run_noting_provider, build_prompt_cache
    handler_class.do_GET = do_get
    if original_scan is not None:
        server.scan_cache_dir = scan_hub_cache(original_scan)
    if tenants is not None:
        if carried is None:
            raise ValueError("patched_server: tenants= needs carried=")
        assert original_batches is not None  # check_tenant_server
        handler_class.do_POST = do_post
        server.ResponseGenerator = tenant_responses(original_responses, carried)
        server.BatchGenerator = tenant_batches(original_batches, carried)
    try:
        yield built
    finally:
        server.run, server.LRUPromptCache = original_run, original_cache_class
        server.ResponseGenerator = original_responses
        if original_batches is not None:
            server.BatchGenerator = original_batches
        handler_class.do_GET, handler_class.do_POST = original_get, original_post
        if original_scan is not None:
            server.scan_cache_dir = original_scan


def serve_metrics(handler: Any, cache: Any) -> None:
    """Answer ``GET /metrics`` on mlx_lm.server's handler: the families of
    `metrics.server_metrics` from the prompt cache's `persistent_stats()` (none before the
    server built it), read at the scrape; a failure to read them is a 500 with its reason.

    Args:
        handler: The server's ``APIHandler`` serving the request.
        cache: The server's `PersistentLRUPromptCache` (None: not built yet).
    """
    try:
        body = exposition(server_metrics(cache.persistent_stats()) if cache is not None else []).encode()
        status, kind = 200, CONTENT_TYPE
    except Exception as exc:  # a store closing under the scrape, say: the server goes on
        body, status, kind = f"metrics unavailable: {type(exc).__name__}: {exc}\n".encode(), 500, "text/plain"
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def refuse(handler: Any, why: str) -> None:
    """Answer a request without a tenant: 401 with one JSON line saying why (never the key),
    and one log line naming the client's address."""
    log.warning("refused a request from %s: %s", handler.client_address[0], why)
    body = json.dumps({"error": {"message": f"unauthorized: {why}", "type": "invalid_request_error",
                                 "code": "invalid_api_key"}}).encode() + b"\n"  # fmt: skip
    handler.send_response(401)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("WWW-Authenticate", "Bearer")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class _NoHubCache:
    """What `scan_hub_cache` answers without a cache: no repositories (the attribute
    ``GET /v1/models`` reads)."""

    repos: frozenset = frozenset()


def scan_hub_cache(scan: Callable[..., Any]) -> Callable[..., Any]:
    """``huggingface_hub.scan_cache_dir`` for ``GET /v1/models``: no cache folder yet (no
    model ever downloaded, a local ``--model`` only) means no downloaded models, not an
    error; a cache that cannot be read is one warning line (once) and no models.

    Args:
        scan: The server's ``scan_cache_dir``.

    Returns:
        A function taking the same arguments.
    """
    warned: list[Exception] = []

    def scan_or_nothing(*args: Any, **kwargs: Any) -> Any:
        try:
            return scan(*args, **kwargs)
        except Exception as exc:  # huggingface_hub's CacheNotFound, or what reading a cache raises
            if type(exc).__name__ != "CacheNotFound" and not warned:
                warned.append(exc)
                log.warning("GET /v1/models lists no downloaded models: the Hugging Face cache "
                            "cannot be read (%s: %s)", type(exc).__name__, exc)  # fmt: skip
            return _NoHubCache()

    return scan_or_nothing


class ProviderStores:
    """Opens the store handle for a model key from the model the server has loaded.

    With tenants, a key is ``(the server's model key, tenant name)``: that model's store
    handle in the tenant's namespace, with its quota and the shared prefixes (stored in
    ``options["namespace"]``, the server's ``--namespace``).

    Args:
        path: The store directory.
        options: Keyword arguments for `PersistentPrefixCache` (namespace, budgets…).
        provider: The server's ``ModelProvider`` (None: every key stays in memory).
        tenants: The server's tenants (None: keys are the server's model keys).
    """

    def __init__(self, path: str, options: dict[str, Any], provider: Any, tenants: Tenants | None = None):
        self.path = path
        self.options = options
        self.provider = provider
        self.tenants = tenants
        self._shared: dict[Hashable, list[list[int]]] = {}  # model key -> the shared prefixes' token ids

    def _split(self, model_key: Hashable) -> tuple[Hashable, Tenant | None]:
        if self.tenants is None:
            return model_key, None
        key, name = cast(tuple, model_key)
        return key, self.tenants.by_name.get(name) or Tenant(name)

    def _tenant_options(self, key: Hashable, tenant: Tenant) -> dict[str, Any]:
        """The options of `tenant`'s handle: its namespace, quota and the shared prefixes."""
        assert self.tenants is not None
        if key not in self._shared:
            tokenizer = getattr(self.provider, "tokenizer", None)
            self._shared[key] = [p.token_ids(tokenizer) for p in self.tenants.shared]
        return {"namespace": tenant.name, "namespace_bytes": tenant.quota, "shared_prefixes": self._shared[key],
                "shared_namespace": self.options.get("namespace", "")}  # fmt: skip

    def model_for(self, model_key: Hashable) -> Any:
        """The loaded model of `model_key`, for the cost model's calibration (the server's
        `PersistentLRUPromptCache` hands it to its link: measured at the first read that
        finds a stored prefix, on the generation thread, as MLX wants); None for another
        key, or with a draft model (the store's layout is then both models')."""
        model_key, _ = self._split(model_key)
        provider = self.provider
        if provider is None or provider.model is None or provider.model_key != model_key:
            return None
        return None if getattr(provider, "draft_model", None) is not None else provider.model

    def __call__(self, model_key: Hashable):
        """The store for `model_key`, or None if that model is not the loaded one."""
        model_key, tenant = self._split(model_key)
        provider = self.provider
        # The server only looks up the model it has loaded; anything else stays in memory.
        if provider is None or provider.model is None or provider.model_key != model_key:
            return None
        model_path, adapter_path, _ = _split_key(model_key)
        model, draft = provider.model, getattr(provider, "draft_model", None)
        options = dict(self.options)
        if tenant is not None:
            options.update(self._tenant_options(model_key, tenant))
        if draft is not None:
            # The server's caches hold the model's layers, then the draft model's.
            model = _WithDraft(model, draft)
            # The older scheme: the value of these derived fingerprints predates the lanes
            # hash and no remembered alias keeps it (weights_hash, docs/fingerprint.md).
            options["fingerprint"] = "with-draft:%s:%s" % (
                fingerprint_model(provider.model, scheme="xxh3"),
                fingerprint_model(draft, scheme="xxh3"),
            )
        elif adapter_path is None:
            # Remembering the fingerprint by file stats is only sound for plain weights:
            # an adapter changes the KV without touching the model folder.
            options["model_path"] = _local_folder(model_path)
        if isinstance(model_path, str):  # the folder or hub id the server loaded: the store's name for it
            name = os.path.abspath(model_path) if os.path.isdir(model_path) else model_path
            if adapter_path is not None:
                name += f" + adapter {adapter_path}"
            options.setdefault("model_name", name if draft is None else f"{name} + draft model")
        store = PersistentPrefixCache(self.path, model, **options)
        log.info(
            "persistent prompt cache for %s: store %s, fingerprint %s%s",
            model_path,
            store.path,
            store.fingerprint[:16],
            "" if tenant is None else f", tenant {tenant.name}",
        )
        return store


class _WithDraft:
    """A model and its draft model seen as one cache layout (what the server builds)."""

    def __init__(self, model: Any, draft: Any):
        self.model, self.draft = model, draft

    def make_cache(self) -> list:
        return model_cache(self.model) + model_cache(self.draft)


def _split_key(model_key: Any) -> tuple[Any, Any, Any]:
    # mlx-lm's key is (model_path, adapter_path, draft_model_path).
    if isinstance(model_key, tuple) and len(model_key) == 3:
        return model_key
    return model_key, None, None


def _local_folder(model_path: Any) -> str | None:
    """The folder the model's files are in, without touching the network."""
    if not isinstance(model_path, str):
        return None
    if os.path.isdir(model_path):
        return model_path
    try:
        from mlx_lm.utils import hf_repo_to_path

        return str(hf_repo_to_path(model_path))
    except Exception:  # not in the local hub cache: hash the weights instead
        return None
