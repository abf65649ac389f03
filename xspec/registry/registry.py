"""A typed, lazy name -> implementation registry with entry-point plugins.

An entry is a light descriptor: a name and a ``"module:attr"`` string. Listing names
reads the built-in table and entry-point *metadata* (``importlib.metadata``) and imports
no implementation; ``get(name)`` imports exactly the one selected. Duplicate names are
refused, never overwritten, whether they clash between built-ins, between built-ins and
an installed plugin, or between two plugins.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar, cast

from xspec.errors import ConfigError, UserError

T = TypeVar("T")

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class DuplicateNameError(UserError, ValueError):
    """Two entries claim one name (a ValueError for code, a UserError for the CLI)."""


@dataclass(frozen=True)
class Entry:
    """One registered implementation, not yet imported."""

    name: str
    target: str  # "module:attr"
    description: str
    origin: str  # "built-in" or "entry point of <distribution>"
    entry_point: EntryPoint | None = None

    def load(self) -> Any:
        """Import the target (an entry point loads through its own ``load()``)."""
        if self.entry_point is not None:
            return self.entry_point.load()
        module_name, _, attr_path = self.target.partition(":")
        value: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            value = getattr(value, attr)
        return value


class Registry(Generic[T]):
    """Names -> lazily imported implementations of one extension point.

    ``kind`` names the extension point in messages ("platform"); ``entry_point_group``
    is where installed packages register (``xspec.platforms``); ``doc`` states what a
    plugin must provide. ``check(name, value)`` (optional) vets a loaded value and
    raises a UserError naming the plugin when it does not fit the contract.
    """

    def __init__(
        self,
        kind: str,
        entry_point_group: str,
        doc: str,
        *,
        check: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.doc = doc
        self.__doc__ = doc
        self._check = check
        self._builtins: dict[str, Entry] = {}

    def register(self, name: str, target: str, *, description: str = "") -> None:
        """Add a built-in entry. ``target`` is ``"module:attr"``; nothing is imported."""
        if not _NAME.match(name):
            raise ValueError(f"{self.kind} name {name!r} must match {_NAME.pattern}")
        if not _TARGET.match(target):
            raise ValueError(
                f"{self.kind} '{name}': target {target!r} must look like 'package.module:Attr'"
            )
        if name in self._builtins:
            raise DuplicateNameError(
                f"{self.kind} '{name}' is already registered as {self._builtins[name].target}; "
                f"refusing to overwrite it with {target} (pick another name)"
            )
        self._builtins[name] = Entry(name, target, description, origin="built-in")

    def names(self) -> list[str]:
        """Built-in and installed names, sorted. Imports no implementation."""
        return sorted(self._entries())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries()

    def entry(self, name: str) -> Entry:
        """The descriptor for ``name``; unknown names raise ConfigError listing known ones."""
        entries = self._entries()
        if name not in entries:
            raise ConfigError(self._unknown_message(name, sorted(entries)))
        return entries[name]

    def describe(self, name: str) -> str:
        """One line for listings: ``name: description [module:attr, origin]``."""
        entry = self.entry(name)
        text = entry.description or "(no description)"
        return f"{entry.name}: {text} [{entry.target}, {entry.origin}]"

    def get(self, name: str) -> T:
        """Import and return the implementation registered as ``name`` (and only that one)."""
        entry = self.entry(name)
        try:
            value = entry.load()
        except (ImportError, AttributeError) as exc:
            if entry.entry_point is None:  # a built-in that fails to import is a bug: keep it loud
                raise ImportError(
                    f"{self.kind} '{name}': cannot import {entry.target}: {exc}"
                ) from exc
            raise ConfigError(
                f"{self.kind} '{name}' ({entry.origin}) failed to import {entry.target}: {exc!r}; "
                "reinstall that package or uninstall it"
            ) from exc
        if self._check is not None:
            self._check(name, value)
        return cast(T, value)

    def _entries(self) -> dict[str, Entry]:
        merged = dict(self._builtins)
        for entry in _installed(self.entry_point_group):
            previous = merged.get(entry.name)
            if previous is None:
                merged[entry.name] = entry
            elif previous.target != entry.target:
                raise DuplicateNameError(
                    f"{self.kind} '{entry.name}' is registered twice: {previous.target} "
                    f"({previous.origin}) and {entry.target} ({entry.origin}); "
                    "uninstall one of the packages or rename its entry point"
                )
            # The same target seen twice (one distribution on two sys.path entries) is harmless.
        return merged

    def _unknown_message(self, name: str, known: list[str]) -> str:
        message = f"unknown {self.kind} '{name}'; known: {', '.join(known) or '(none)'}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            message += f" (did you mean '{close[0]}'?)"
        return message

    def __repr__(self) -> str:
        return f"Registry(kind={self.kind!r}, entry_point_group={self.entry_point_group!r})"


def _installed(group: str) -> list[Entry]:
    """Entries declared by installed distributions in ``group`` (metadata only, no import)."""
    found = []
    for ep in entry_points(group=group):
        dist = getattr(ep, "dist", None)
        if dist is not None:
            origin = f"entry point of {dist.metadata['Name']} {dist.version}"
            description = dist.metadata.get("Summary") or ""
        else:
            origin, description = "entry point", ""
        found.append(Entry(ep.name, ep.value, description, origin=origin, entry_point=ep))
    return found
