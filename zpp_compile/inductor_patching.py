"""Replacements for functions of Inductor's that act only inside zeropp's own compiles.

A ScopedPatch puts its replacements in place once per process, on first use, and they stay; each
replacement asks `active()` and, outside a `scope()`, hands the call to the function it replaced,
so the user's other compiles (and the DDP baselines of the benchmarks) run Inductor as shipped.
The scope is a context variable: it holds in the thread that enters it (and in tasks copying its
context), not in Inductor's worker processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator


class ScopedPatch:
    """`replacements` (attribute name -> function) replace those attributes of `owner()`."""

    def __init__(self, name: str, owner: Callable[[], Any], replacements: dict[str, Callable[..., Any]]) -> None:
        self._active = contextvars.ContextVar(name, default=False)
        self._owner = owner  # a callable: the owner's module is imported only on first use
        self._replacements = replacements
        self._originals: dict[str, Callable[..., Any]] = {}
        self._installing = threading.Lock()

    def active(self) -> bool:
        return self._active.get()

    def original(self, attribute: str) -> Callable[..., Any]:
        """What `attribute` was before the replacement (installing it first, if need be)."""
        self.install()
        return self._originals[attribute]

    def install(self) -> None:
        if self._originals:  # installed: every replaced call asks, so no lock on this path
            return
        # Under the lock: two threads installing at once would keep a replacement as the original.
        with self._installing:
            if self._originals:
                return
            owner = self._owner()
            self._originals.update({name: getattr(owner, name) for name in self._replacements})
            for name, replacement in self._replacements.items():
                setattr(owner, name, replacement)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Within: the replacements act."""
        self.install()
        token = self._active.set(True)
        try:
            yield
        finally:
            self._active.reset(token)
