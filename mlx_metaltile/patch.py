"""``patch(model)``: put this package's kernels into an ``mlx.nn.Module`` tree, in place.

Per instance:
  - mlx-lm's gated RMSNorm (``Qwen3NextRMSNormGated``) -> :class:`mlx_metaltile.nn.GatedRMSNorm`
  - any mlx-lm ``SwitchGLU`` over ``QuantizedSwitchLinear`` experts -> :class:`mlx_metaltile.nn.SwitchGLU`
  - mlx-lm MoE blocks whose routing :data:`mlx_metaltile.nn.MOE_ROUTING` names, holding served
    experts: the instance gets a subclass whose ``__call__`` is :func:`mlx_metaltile.nn.moe_block`
    (the block's router, then ``SwitchGLU.combine``); other blocks holding a SwitchGLU are
    reported and keep mlx-lm's code.
  - ``nn.QuantizedLinear`` in mode mxfp4 / nvfp4 -> :class:`mlx_metaltile.nn.Fp4Linear`
  - attention modules that call mlx-lm's ``scaled_dot_product_attention``: the instance gets
    a subclass whose ``__call__`` routes that call to ``sdpa_multi``.

Process-wide: mlx-lm's attention looks ``scaled_dot_product_attention`` up by name in its
model module, so the first patch of such a module's attention installs there one router
that forwards every call to mlx-lm's function unless it comes from a patched instance.
It stays installed after ``unpatch`` (forwarding everything, bit for bit).

Sharded models (``model.shard(group)`` of mlx-lm over ``mx.distributed``): patch before or
after sharding. Sharding keeps the instances patched (attention is patched per instance;
``shard_inplace`` shards the experts' arrays inside the stand-in); ``shard_linear``
replaces linear layers by mlx's tensor-parallel ones, which a patch after sharding serves
(mxfp4 / nvfp4) and a patch before sharding never sees.
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import sys
from collections import Counter
from dataclasses import dataclass, field

import mlx.nn as nn

from . import nn as mtnn

_SDPA_NAME = "scaled_dot_product_attention"
_in_patched_attention: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mlx_metaltile_patched_attention", default=False)
# In a patched attention call with a KVCache: (the cache, the list its update_and_fetch
# fills with the (keys, values) it returned in this call).
_fetched: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "mlx_metaltile_fetched", default=None)
_patched_classes: dict[type, type] = {}


@dataclass(frozen=True)
class PatchEntry:
    path: str  # the module's path in the tree, e.g. "model.layers.0.mlp.switch_mlp"
    kind: str  # "gated_rms_norm" | "switch_glu" | "attention" | "fp4_linear" | ...
    module: str  # the class name before patching
    replaced: bool
    detail: str  # what serves it, or why it was left


@dataclass
class PatchReport:
    """What :func:`patch` replaced and what it left (with why). Prints as a table."""

    entries: list[PatchEntry] = field(default_factory=list)

    @property
    def replaced(self) -> list[PatchEntry]:
        return [e for e in self.entries if e.replaced]

    @property
    def left(self) -> list[PatchEntry]:
        return [e for e in self.entries if not e.replaced]

    def rows(self) -> list[tuple[str, str, str, int, str, str]]:
        """(status, kind, module, count, detail, first path), one per distinct case."""
        groups: dict[tuple, list[str]] = {}
        for e in self.entries:
            key = ("replaced" if e.replaced else "left", e.kind, e.module, e.detail)
            groups.setdefault(key, []).append(e.path)
        return [(s, k, m, len(p), d, p[0]) for (s, k, m, d), p in groups.items()]

    def __str__(self) -> str:
        if not self.entries:
            return "PatchReport: nothing in this model is served by mlx_metaltile"
        head = ("status", "kind", "module", "n", "detail", "e.g.")
        body = [tuple(str(c) for c in r) for r in self.rows()]
        widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
        lines = [f"PatchReport: {len(self.replaced)} replaced, {len(self.left)} left"]
        for r in (head, *body):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.entries:
            return f"<p>{html.escape(str(self))}</p>"
        head = "".join(f"<th>{h}</th>" for h in ("status", "kind", "module", "n", "detail",
                                                "e.g."))
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r)
                       + "</tr>" for r in self.rows())
        return (f"<p>PatchReport: {len(self.replaced)} replaced, {len(self.left)} left</p>"
                f"<table><tr>{head}</tr>{rows}</table>")

    def counts(self) -> Counter:
        """(kind, replaced) -> number of modules."""
        return Counter((e.kind, e.replaced) for e in self.entries)


# ------------------------------------------------------------------ attention routing


def _router(original):
    """The function installed in a model module in place of mlx-lm's sdpa function."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if _in_patched_attention.get():
            watched = _fetched.get()
            fetched = watched[1] if watched is not None and watched[0] is cache else ()
            reason = mtnn.sdpa_unserved(queries, keys, values, cache, mask, sinks, fetched)
            if reason is None:
                return mtnn.cached_attention(queries, keys, values, cache, scale, mask, sinks)
            mtnn.fallbacks["attention", reason] += 1
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention._mlx_metaltile_router = True
    return scaled_dot_product_attention


def _attention_namespace(module) -> dict | None:
    """The globals the module's ``__call__`` looks the sdpa function up in, if it calls
    mlx-lm's ``scaled_dot_product_attention`` by name; else None."""
    call = type(module).__call__ if callable(module) else None
    code = getattr(call, "__code__", None)
    if code is None or _SDPA_NAME not in code.co_names:
        return None
    return call.__globals__


def _mlx_lm_sdpa():
    base = sys.modules.get("mlx_lm.models.base")
    return getattr(base, _SDPA_NAME, None)


def _patched_class(cls: type, kind: str = "attention") -> type:
    """``cls`` with the call of ``kind``: attention routes mlx-lm's sdpa function,
    moe_block runs :func:`mlx_metaltile.nn.moe_block`. One subclass per class."""
    sub = _patched_classes.get(cls)
    if sub is None:
        if kind == "moe_block":
            __call__ = mtnn.moe_block
        else:
            def __call__(self, *args, **kwargs):
                token = _in_patched_attention.set(True)
                try:
                    cache = _kv_cache_arg(args, kwargs)
                    if cache is None:
                        return cls.__call__(self, *args, **kwargs)
                    with _watch_fetch(cache):
                        return cls.__call__(self, *args, **kwargs)
                finally:
                    _in_patched_attention.reset(token)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "_mlx_metaltile_base": cls,
                                          "_mlx_metaltile_kind": kind})
        _patched_classes[cls] = sub
    return sub


def _kv_cache_arg(args, kwargs):
    """The mlx-lm KVCache (that class exactly) an attention call was given (as ``cache=``,
    else the first such argument), or None."""
    cache = kwargs.get("cache")
    if type(cache).__name__ != "KVCache":
        cache = next((a for a in (*args, *kwargs.values())
                      if type(a).__name__ == "KVCache"), None)
        if cache is None:
            return None
    return cache if type(cache) is mtnn._kv_cache_class() else None


@contextlib.contextmanager
def _watch_fetch(cache):
    """For the duration: ``cache.update_and_fetch`` records the (keys, values) it returns,
    so that the router serves only calls given exactly those arrays, which are the first
    ``offset`` rows of the cache's buffers that sdpa_multi reads in their place. An
    attention that derives its keys or values from what the cache holds (DeepSeek's
    multi-head latent attention caches a latent and a rotary key, then attends up-projected
    keys and values) passes other arrays, and runs mlx-lm's sdpa. The instance attribute
    shadows the class's method (the cache keeps its type) and is removed afterwards."""
    own = cache.__dict__.get("update_and_fetch")  # normally none: the class's method
    fetch = own if own is not None else type(cache).update_and_fetch.__get__(cache)
    fetched: list = []

    def update_and_fetch(keys, values):
        out = fetch(keys, values)
        fetched[:] = out
        return out

    cache.update_and_fetch = update_and_fetch
    token = _fetched.set((cache, fetched))
    try:
        yield
    finally:
        _fetched.reset(token)
        if own is None:
            del cache.__dict__["update_and_fetch"]
        else:
            cache.update_and_fetch = own


def _attention_left(module) -> str | None:
    """For an attention module calling sdpa by name: None if it can be patched, else why not."""
    namespace = _attention_namespace(module)
    sdpa = namespace.get(_SDPA_NAME)
    if getattr(sdpa, "_mlx_metaltile_router", False):
        sdpa = sdpa.__wrapped__
    if sdpa is None or sdpa is not _mlx_lm_sdpa():
        return "calls its own attention function, not mlx-lm's"
    return mtnn.attention_unserved(module)


def _patch_attention(module) -> None:
    namespace = _attention_namespace(module)
    if not getattr(namespace[_SDPA_NAME], "_mlx_metaltile_router", False):
        namespace[_SDPA_NAME] = _router(namespace[_SDPA_NAME])
    module.__class__ = _patched_class(type(module))


# ------------------------------------------------------------------ the walk


def _is_attention(module) -> bool:
    return _attention_namespace(module) is not None


def _is_switch_glu(module) -> bool:
    return type(module).__name__ == "SwitchGLU" and type(module).__module__.startswith("mlx_lm.")


def _visit(module, path: str, entries: list[PatchEntry]):
    """The replacement for ``module`` (or ``module`` itself), recording what was decided."""
    name = type(module).__name__
    if isinstance(module, tuple(_STAND_IN_KINDS)):  # patched before
        kind = _STAND_IN_KINDS[type(module)]
        original = getattr(module, "_mlx_metaltile_original", module)
        entries.append(PatchEntry(path, kind, type(original).__name__, True,
                                  _SERVED_BY[kind]))
        return module
    if hasattr(type(module), "_mlx_metaltile_base"):  # attention or MoE block patched before
        kind = type(module)._mlx_metaltile_kind
        entries.append(PatchEntry(path, kind, name, True, _served_by(kind, module)))
        _walk(module, path, entries)
        return module
    if mtnn.moe_routing(type(module)) is not None or any(
            _is_switch_glu(child) for _, _, child, _ in _children(module)):
        reason = mtnn.moe_block_unserved(module)
        if reason is None:
            module.__class__ = _patched_class(type(module), "moe_block")
        entries.append(PatchEntry(path, "moe_block", name, reason is None,
                                  reason or _served_by("moe_block", module)))
        _walk(module, path, entries)
        return module
    if name == "Qwen3NextRMSNormGated":
        return _replace(module, path, "gated_rms_norm", mtnn.gated_rms_norm_unserved,
                        mtnn.GatedRMSNorm, entries)
    if _is_switch_glu(module):
        return _replace(module, path, "switch_glu", mtnn.switch_glu_unserved, mtnn.SwitchGLU,
                        entries)
    if name == "SwitchMLP" and type(module).__module__.startswith("mlx_lm."):
        entries.append(PatchEntry(path, "switch_mlp", name, False,
                                  "no kernel path for a non-gated expert MLP"))
        return module
    if name in _SHARDED_FP4 and getattr(module, "mode", "affine") != "affine":
        return _replace(module, path, "fp4_linear", mtnn.fp4_linear_unserved,
                        _SHARDED_FP4[name], entries)
    if name == "QuantizedLinear" and getattr(module, "mode", "affine") != "affine":
        return _replace(module, path, "fp4_linear", mtnn.fp4_linear_unserved, mtnn.Fp4Linear,
                        entries)
    if _is_attention(module):
        reason = _attention_left(module)
        if reason is None:
            _patch_attention(module)
        entries.append(PatchEntry(path, "attention", name, reason is None,
                                  reason or _SERVED_BY["attention"]))
    _walk(module, path, entries)
    return module


# mlx.nn's tensor-parallel quantized layers (made by ``shard_linear``) -> their stand-ins
_SHARDED_FP4 = {"QuantizedAllToShardedLinear": mtnn.Fp4AllToShardedLinear,
                "QuantizedShardedToAllLinear": mtnn.Fp4ShardedToAllLinear}
_FP4_LINEARS = (mtnn.Fp4Linear, *_SHARDED_FP4.values())  # share the original's state
_STAND_IN_KINDS = {mtnn.GatedRMSNorm: "gated_rms_norm", mtnn.SwitchGLU: "switch_glu",
                   **dict.fromkeys(_FP4_LINEARS, "fp4_linear")}
_SERVED_BY = {
    "fp4_linear": "fp4_qmm",
    "gated_rms_norm": "gated_rms_norm (no gate: mx.fast.rms_norm)",
    "switch_glu": f"expert_glu + expert_qmv (< {mtnn.PREFILL_MIN_PAIRS} token-expert pairs), "
                  "moe_gather_qmm (more)",
    "moe_block": "the router's matmul, then moe_route (top k <= 32) + expert_glu + "
                 f"expert_down_combine (< {mtnn.PREFILL_MIN_PAIRS} token-expert pairs)",
    "attention": "sdpa_multi (the KVCache's own keys and values, or no cache; mask None, "
                 "'causal' or an array over the keys; others: mlx-lm)",
}
# a block whose router gives the ids and scores itself (MoERouting.router_ids)
_ROUTER_IDS_SERVED_BY = ("the router's own ids and scores (mlx-lm's code), then expert_glu + "
                         f"expert_down_combine (< {mtnn.PREFILL_MIN_PAIRS} token-expert pairs)")


def _served_by(kind: str, module) -> str:
    """What serves a replaced module of ``kind`` (the report's detail)."""
    if kind == "moe_block":
        routing = mtnn.moe_routing(type(module))
        if routing is not None and routing.router_ids:
            return _ROUTER_IDS_SERVED_BY
    return _SERVED_BY[kind]


def _replace(module, path, kind, unserved, cls, entries):
    reason = unserved(module)
    entries.append(PatchEntry(path, kind, type(module).__name__, reason is None,
                              reason or _SERVED_BY[kind]))
    if reason is not None:
        return module
    new = cls.from_module(module)
    object.__setattr__(new, "_mlx_metaltile_original", module)
    return new


def _children(module):
    """(container, key, child module, path suffix) for each direct child module."""
    for key, value in list(module.items()):
        if isinstance(value, nn.Module):
            yield module, key, value, key
        elif isinstance(value, list | dict):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in list(items):
                if isinstance(v, nn.Module):
                    yield value, k, v, f"{key}.{k}"


def _walk(module, path: str, entries: list[PatchEntry]) -> None:
    for container, key, child, suffix in _children(module):
        new = _visit(child, f"{path}.{suffix}" if path else suffix, entries)
        if new is not child:
            container[key] = new


def patch(model) -> PatchReport:
    """Replace in place every sub-module of ``model`` the kernels can serve.

    Returns a :class:`PatchReport` of what was replaced and what was left, with why.
    Patching a patched model changes nothing (and reports the same). The replaced modules
    hold the same parameters under the same names; :func:`unpatch` restores the originals.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"[patch] model must be an mlx.nn.Module, got {type(model).__name__}")
    entries: list[PatchEntry] = []
    _walk(model, "", entries)
    return PatchReport(entries)


def _restore(module):
    original = getattr(module, "_mlx_metaltile_original", None)
    if original is not None:
        for key, value in module.items():  # parameters and children loaded after patching
            original[key] = value
        if hasattr(module, "eps"):
            original.eps = module.eps
        if not isinstance(module, _FP4_LINEARS):  # these share original's state
            original.train(module.training)
        return original
    base = getattr(type(module), "_mlx_metaltile_base", None)
    if base is not None:
        module.__class__ = base
    _unwalk(module)
    return module


def _unwalk(module) -> None:
    for container, key, child, _ in _children(module):
        new = _restore(child)
        if new is not child:
            container[key] = new


def unpatch(model) -> None:
    """Put back the modules :func:`patch` replaced (with any weights loaded since)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"[unpatch] model must be an mlx.nn.Module, got {type(model).__name__}")
    _unwalk(model)
