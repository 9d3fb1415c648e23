"""Rows of a growable table, each held by one running request across steps and reused once released: the block
tables' rows and the sampling state's rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from batchgen.core.request import Request


class RowEntry(Protocol):
    row: int


EntryT = TypeVar("EntryT", bound=RowEntry)


class RequestRows(Generic[EntryT]):
    """Keyed by object identity: request ids repeat across generate calls and among a prompt's samples. Each entry
    keeps its request alive, so the request's id() cannot be reused while it holds a row."""

    def __init__(self, make_entry: Callable[[int], EntryT], free_rows: Iterable[int] = ()):
        self._make_entry = make_entry  # row -> the entry that holds it
        self._free_rows = sorted(free_rows, reverse=True)  # popped lowest first
        self._entries: dict[int, tuple[Request, EntryT]] = {}

    def held(self, request: Request) -> EntryT | None:
        """The request's entry if it holds a row (the cheap lookup of a request seen at an earlier step)."""
        held = self._entries.get(id(request))
        return held[1] if held is not None else None

    def entry(self, request: Request, grow: Callable[[], Iterable[int]]) -> tuple[EntryT, bool]:
        """The request's entry, and whether its row was taken just now. grow enlarges the table when no row is free
        and returns the rows it added (passed per call, not kept: a bound method kept here would make its table a
        reference cycle, freed only by the garbage collector, and the sampling state's table is GPU memory)."""
        held = self._entries.get(id(request))
        if held is not None:
            return held[1], False
        return self.entries([request], grow)[0], True

    def entries(self, requests: list[Request], grow: Callable[[], Iterable[int]]) -> list[EntryT]:
        """entry(request, grow)[0] of each request, in one pass: a prefill step brings hundreds of new requests."""
        held_entries, make_entry, free_rows = self._entries, self._make_entry, self._free_rows
        entries = []
        for request in requests:
            held = held_entries.get(id(request))
            if held is not None:
                entries.append(held[1])
                continue
            if not free_rows:
                free_rows = self._free_rows = sorted(grow(), reverse=True)
            entry = make_entry(free_rows.pop())
            held_entries[id(request)] = (request, entry)
            entries.append(entry)
        return entries

    def release(self, requests: list[Request]) -> None:
        for request in requests:
            held = self._entries.pop(id(request), None)
            if held is not None:
                self._free_rows.append(held[1].row)
