"""``optimizer.state`` of distmuon.torch.Muon: per parameter, views of the engine's state.

torch's optimizers read their state from ``optimizer.state`` at every step, so code that
deletes or replaces an entry (``del opt.state[p]`` to start a re-initialised layer fresh, a new
tensor under ``'momentum_buffer'``) changes what the next step does. distmuon's state lives in
its engine and ``optimizer.state`` only views it: in-place changes of the tensors reach the
engine, but assignments and deletions would be silently lost. These classes record them (one
flag), and the optimizer applies them at its next step (``edits``), as torch would see them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class _MarksEdits:
    """dict's mutating methods, each marking an edit (``_mark``) before it acts."""

    def _mark(self) -> None:
        raise NotImplementedError

    def __setitem__(self, k: Any, v: Any) -> None:
        self._mark()
        super().__setitem__(k, v)  # type: ignore[misc]

    def __delitem__(self, k: Any) -> None:
        self._mark()
        super().__delitem__(k)  # type: ignore[misc]

    def clear(self) -> None:
        self._mark()
        super().clear()  # type: ignore[misc]

    def pop(self, *args: Any) -> Any:
        self._mark()
        return super().pop(*args)  # type: ignore[misc]

    def popitem(self) -> Any:
        self._mark()
        return super().popitem()  # type: ignore[misc]

    def update(self, *args: Any, **kw: Any) -> None:
        self._mark()
        super().update(*args, **kw)  # type: ignore[misc]

    def setdefault(self, k: Any, default: Any = None) -> Any:
        if k not in self:  # type: ignore[operator]
            self._mark()
        return super().setdefault(k, default)  # type: ignore[misc]


class StateEntry(_MarksEdits, dict):  # type: ignore[type-arg]
    """One parameter's state; changing its keys marks the view edited."""

    def __init__(self, view: StateView, *args: Any) -> None:
        dict.__init__(self, *args)
        self._view = view

    def _mark(self) -> None:
        self._view.edited = True


class StateView(_MarksEdits, defaultdict):  # type: ignore[type-arg]
    """``optimizer.state``: a defaultdict(dict) as torch's, whose entries are StateEntry views.
    Reading a parameter without state gives an empty entry, as torch's, without marking an edit."""

    def __init__(self) -> None:
        defaultdict.__init__(self, dict)
        self.edited = False

    def _mark(self) -> None:
        self.edited = True

    @classmethod
    def of(cls, entries: dict[Any, dict[str, Any]]) -> StateView:
        view = cls()
        for p, st in entries.items():
            dict.__setitem__(view, p, StateEntry(view, st))
        return view

    def __missing__(self, k: Any) -> StateEntry:
        entry = StateEntry(self)
        dict.__setitem__(self, k, entry)
        return entry


def edits(view: Any, original: dict[int, dict[str, Any]], params: list[Any]) -> dict[int, dict[str, Any] | None]:
    """What the user changed in `view` since it was made from `original` (id(param) -> entry,
    its values as they were): per index into `params`, None where the entry is gone or was
    replaced by an empty one (the parameter starts fresh), else the keys whose value is another
    object now (a new tensor, a new step)."""
    out: dict[int, dict[str, Any] | None] = {}
    for i, p in enumerate(params):
        before = original.get(id(p))
        if before is None:
            continue
        now = dict.get(view, p)
        if not now:
            out[i] = None
            continue
        changed = {k: v for k, v in now.items() if before.get(k) is not v}
        if changed:
            out[i] = changed
    return out
