"""Kernel registry: one interface per op, a pure-torch reference always registered.

Backends are chosen by name, explicitly. ``torch`` is always available; optional backends
(``flashinfer``) register a loader that imports their library only when asked for, and a
backend that cannot run raises ``KernelBackendUnavailable`` naming it: never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.kernels.interface import AttentionGeometry, HostLayout, KernelBackend, PagedAttentionMeta
from runtime.kernels.torch_ref import TorchReference


class KernelBackendUnavailable(RuntimeError):
    """A requested kernel backend is unknown or cannot run here."""


def _load_flashinfer() -> KernelBackend:
    from runtime.kernels.flashinfer_backend import FlashInferBackend

    return FlashInferBackend()


_LOADERS: dict[str, Callable[[], KernelBackend]] = {
    "torch": TorchReference,
    "flashinfer": _load_flashinfer,
}
_LOADED: dict[str, KernelBackend] = {}


def register_backend(name: str, loader: Callable[[], KernelBackend]) -> None:
    """Register (or replace) a lazily loaded backend."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def available_backends() -> list[str]:
    return sorted(_LOADERS)


def get_backend(name: str) -> KernelBackend:
    """The backend called ``name``; raises ``KernelBackendUnavailable`` if unknown or unusable."""
    if name not in _LOADERS:
        raise KernelBackendUnavailable(f"unknown kernel backend {name!r}; choose one of {available_backends()}")
    if name not in _LOADED:
        _LOADED[name] = _LOADERS[name]()
    return _LOADED[name]


__all__ = ["AttentionGeometry", "HostLayout", "KernelBackend", "KernelBackendUnavailable", "PagedAttentionMeta",
           "available_backends", "get_backend", "register_backend"]
