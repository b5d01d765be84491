"""Declared differences: what a candidate says it does differently, on purpose.

A candidate may declare (in its file's top-level ``"declare"``, from the command line
with ``--declare key=value``, or as the ``declare`` argument of the API):

``scores``
    ``"exact"`` (default): score values are compared within tolerance;
    ``"positive_multiple"``: the candidate's scores are ``c * s`` for one ``c > 0`` per
    KV head (kvpress's SnapKV takes the mean over the window, refkv the sum): ``c`` is
    estimated and the rescaled values compared;
    ``"monotone"``: an increasing transform (StreamingLLM's 1/0 encoding): only the
    ranking is compared -- every pair the reference orders beyond the tie tolerance must
    be ordered the same way.
``pinned``
    ``"protected"`` or a list of positions: columns the candidate pads (protected tokens
    given ``max + 1``); their score values are not compared. Kept sets still are.
``kept_only``
    ``true``: scores are not compared at all; the reference's scores serve the tie rule.

None of these can hide a different *decision*: kept sets are always compared, tie-aware.
Every declaration is printed in the report, with where it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..validation import check_choice

__all__ = ["SCORE_RELATIONS", "Declarations", "parse_cli_declaration"]

SCORE_RELATIONS = ("exact", "positive_multiple", "monotone")
_KEYS = ("scores", "pinned", "kept_only")


@dataclass(frozen=True)
class Declarations:
    """Validated declarations and where each came from (``sources[key]``)."""

    scores: str = "exact"
    pinned: str | tuple = ()
    kept_only: bool = False
    sources: dict = field(default_factory=dict, compare=False)
    overridden: tuple = field(default=(), compare=False)

    @classmethod
    def parse(cls, obj, source: str = "argument") -> Declarations:
        """From a dict (or None, or a Declarations); ValueError naming a bad key or value."""
        if obj is None:
            return cls()
        if isinstance(obj, Declarations):
            return obj
        if not isinstance(obj, Mapping):
            raise ValueError(f"declare must be a dict with keys {', '.join(_KEYS)}, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(_KEYS))
        if unknown:
            raise ValueError(f"declare has unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_KEYS)}")
        values = {}
        if "scores" in obj:
            values["scores"] = check_choice("declare scores", obj["scores"], SCORE_RELATIONS)
        if "pinned" in obj:
            pinned = obj["pinned"]
            if pinned != "protected":
                if isinstance(pinned, (str, bytes)) or not hasattr(pinned, "__iter__"):
                    raise ValueError(f"declare pinned must be 'protected' or a list of positions, got {pinned!r}")
                pinned = tuple(pinned)
                if not all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) and p >= 0 for p in pinned):
                    raise ValueError(f"declare pinned positions must be integers >= 0, got {list(pinned)!r}")
                pinned = tuple(sorted(int(p) for p in pinned))
            values["pinned"] = pinned
        if "kept_only" in obj:
            if not isinstance(obj["kept_only"], (bool, np.bool_)):
                raise ValueError(f"declare kept_only must be true or false, got {obj['kept_only']!r}")
            values["kept_only"] = bool(obj["kept_only"])
        return cls(**values, sources={k: source for k in values})

    def merged(self, other: Declarations) -> Declarations:
        """These declarations with ``other``'s on top (the command line over the file)."""
        values = {k: getattr(self, k) for k in _KEYS}
        sources = dict(self.sources)
        overridden = list(self.overridden)
        for key, source in other.sources.items():
            if key in sources and getattr(self, key) != getattr(other, key):
                overridden.append(f"{key}={_show(getattr(self, key))} ({sources[key]})")
            values[key] = getattr(other, key)
            sources[key] = source
        return Declarations(**values, sources=sources, overridden=tuple(overridden))

    def pinned_mask(self, positions: np.ndarray, protected: np.ndarray) -> np.ndarray:
        """Columns whose score values are not compared."""
        if self.pinned == "protected":
            return np.asarray(protected, dtype=bool)
        if not self.pinned:
            return np.zeros(np.shape(positions), dtype=bool)
        return np.isin(positions, np.asarray(self.pinned))

    def lines(self) -> list[str]:
        """One line per declaration made (the defaults are not listed)."""
        out = [f"declared {key}={_show(getattr(self, key))} ({self.sources[key]})" for key in _KEYS
               if key in self.sources]
        out += [f"overridden: {o}" for o in self.overridden]
        return out


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def parse_cli_declaration(text: str) -> tuple[str, object]:
    """``"scores=monotone"``, ``"pinned=protected"``, ``"pinned=0,1,2"``, ``"kept_only=true"``."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in _KEYS:
        raise ValueError(f"--declare must be KEY=VALUE with KEY one of {', '.join(_KEYS)}, got {text!r}")
    value = value.strip()
    if key == "kept_only":
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"--declare kept_only must be true or false, got {value!r}")
        return key, value.lower() in ("true", "1", "yes")
    if key == "pinned" and value != "protected":
        try:
            return key, [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--declare pinned must be 'protected' or positions like 0,1,2, got {value!r}") from None
    return key, value
