"""Small text formatting helpers shared by the library and the CLI (a leaf module)."""

from __future__ import annotations

import html
import re

import numpy as np

__all__ = ["BIDI_CONTROLS", "format_position_set", "format_ranges", "html_text", "terminal_text"]

#: Bidirectional controls: embeddings and overrides U+202A-U+202E, isolates U+2066-U+2069, the
#: marks U+200E/U+200F (and U+061C). Raw, they reorder what follows them on screen (a prompt
#: holding U+202E shows its text backwards, "Trojan source"); refkv shows them as ``<U+202E>``.
BIDI_CONTROLS = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"

_BIDI = re.compile(f"[{BIDI_CONTROLS}]")
# C0 controls but tab and newline, DEL, C1 controls (ESC starts a terminal escape sequence; CSI
# U+009B is one alone), and the bidirectional controls, for the terminal.
_TERMINAL = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{BIDI_CONTROLS}]")
_HTML_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _visible(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"<U+{code:04X}>"


def terminal_text(text, *, newlines: bool = True) -> str:
    """``text`` safe to print to a terminal: control characters shown, never obeyed.

    Every C0 and C1 control character (``ESC`` included: an escape sequence in a file name
    would otherwise recolour, retitle or clear the terminal), DEL, and every bidirectional
    control (:data:`BIDI_CONTROLS`) is replaced by a visible escape: ``\\x1b`` for a byte,
    ``<U+202E>`` for a bidirectional control. Tab is kept; newline is kept unless
    ``newlines=False`` (then shown as ``\\x0a``). The one helper for user-supplied paths
    and text that refkv prints.
    """
    text = str(text)
    if not newlines:
        text = text.replace("\n", "\\x0a").replace("\t", "\\x09")
    return _TERMINAL.sub(lambda match: _visible(match.group()), text)


def html_text(text) -> str:
    """``text`` escaped for HTML (element content and quoted attributes), controls neutralised.

    :func:`html.escape` (``&``, ``<``, ``>`` and both quotes), then every bidirectional
    control (:data:`BIDI_CONTROLS`) shown as the visible text ``<U+202E>`` and every other
    control character but tab, newline and carriage return as ``\\x1b``: nothing a prompt
    holds can reorder or hide the page's text. The one helper for text that goes into a page.
    """
    text = html.escape(str(text), quote=True)
    text = _BIDI.sub(lambda match: html.escape(f"<U+{ord(match.group()):04X}>"), text)
    return _HTML_CONTROLS.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def format_ranges(positions: np.ndarray) -> str:
    """Compress sorted positions into ``"0-3,120-135"`` style ranges (``"-"`` when empty)."""
    if len(positions) == 0:
        return "-"
    parts, start, prev = [], int(positions[0]), int(positions[0])
    for p in map(int, positions[1:]):
        if p != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = p
        prev = p
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def format_position_set(positions) -> str:
    """Positions in any order (a kept set) as sorted ranges: :func:`format_ranges` of them sorted."""
    return format_ranges(np.sort(np.asarray(positions)))
