"""Comparison of a candidate's outputs with refkv's: arrays, retention, files, suites.

Arrays are compared as ONNX's backend tests do, in order: shape, then dtype, then values
(``|actual - desired| <= atol + rtol * |desired|``, NaN equal to NaN, infinities equal
only to themselves). The first thing that differs is reported, with its index.

Retention is compared tie-aware. Per KV head, let ``dropped`` be the tokens the reference
keeps and the candidate evicts, and ``extra`` the tokens the candidate keeps instead. The
head passes if the sets are equal; it is a **tie** (accepted, and reported) if nothing
protected was dropped and every pair ``(d, e)`` of ``dropped x extra`` has reference
scores within the tolerance, ``|s_d - s_e| <= atol + rtol * max(|s_d|, |s_e|)``; else it
fails, and the report names the pair that is furthest outside the tolerance. "At most"
rather than "less than", so an exact tie is accepted even at tolerance 0.

End to end (:func:`compare_end_to_end`), decisions are walked in order of block, layer and
KV head, with the reference scores recorded at each decision. An accepted tie changes the
cache, so what follows may legitimately differ: a tie at (block ``b``, layer ``l``) makes
every decision at (``b' > b``, ``l' >= l``) -- and, for a policy that evicts before
attention, at (``b``, ``l' > l``) -- and the final logits, if they depend on it,
*unchecked*; the report counts them. Without a tie, everything is compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

__all__ = [
    "CaseResult",
    "FileReport",
    "Mismatch",
    "RetentionResult",
    "SuiteReport",
    "Swap",
    "check_end_to_end_file",
    "check_suite",
    "check_vector_file",
    "compare_arrays",
    "compare_case",
    "compare_end_to_end",
    "compare_kept",
    "compare_retention",
]


def _fmt(x, digits: int = 10) -> str:
    x = float(x)
    return repr(x) if not np.isfinite(x) else f"{x:.{digits}g}"


def _fmt_pair(a, b) -> tuple[str, str]:
    """Two numbers with the fewest digits (at least 6) that still tell them apart."""
    a, b = float(a), float(b)
    for digits in range(6, 18):
        sa, sb = _fmt(a, digits), _fmt(b, digits)
        if sa != sb or a == b:
            return sa, sb
    return repr(a), repr(b)


# -- arrays -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mismatch:
    """The first way two arrays differ: ``kind`` is ``"shape"``, ``"dtype"`` or ``"values"``."""

    kind: str
    message: str
    index: tuple | None = None
    actual: float | None = None
    desired: float | None = None
    count: int = 0
    total: int = 0


def _default_index(index: tuple) -> str:
    return "index " + (str(index[0]) if len(index) == 1 else str(tuple(int(i) for i in index)))


def _dtype_mismatch(actual: np.dtype, desired: np.dtype, check_dtype) -> str | None:
    if check_dtype is False:
        return None
    if check_dtype == "kind":
        kinds = {"f": "float", "i": "integer", "u": "integer", "b": "bool", "c": "complex"}
        if kinds.get(actual.kind, actual.kind) != kinds.get(desired.kind, desired.kind):
            return (f"dtype mismatch: actual {actual} ({kinds.get(actual.kind, actual.kind)}), "
                    f"desired {desired} ({kinds.get(desired.kind, desired.kind)})")
        return None
    if actual != desired:
        return f"dtype mismatch: actual {actual}, desired {desired}"
    return None


def compare_arrays(actual, desired, *, rtol: float = 0.0, atol: float = 0.0, check_dtype="kind",
                   describe_index: Callable[[tuple], str] | None = None) -> Mismatch | None:
    """Compare shape, then dtype, then values; ``None`` if they agree.

    Parameters
    ----------
    actual, desired : array_like
    rtol, atol : float
        Values agree where ``|actual - desired| <= atol + rtol * |desired|``.
    check_dtype : {"kind", True, False}
        ``"kind"``: both float, both integer or both bool (a float32 kernel may be checked
        against float64 expectations); ``True``: identical dtypes; ``False``: no check.
    describe_index : callable, optional
        Turns an index tuple into words (``"head 1, position 7"``).
    """
    actual, desired = np.asarray(actual), np.asarray(desired)
    name = describe_index or _default_index
    if actual.shape != desired.shape:
        return Mismatch("shape", f"shape mismatch: actual {actual.shape}, desired {desired.shape}")
    msg = _dtype_mismatch(actual.dtype, desired.dtype, check_dtype)
    if msg:
        return Mismatch("dtype", msg)
    if actual.size == 0:
        return None
    if actual.dtype.kind in "fc" or desired.dtype.kind in "fc":
        a, d = actual.astype(np.float64), desired.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(a - d)
            allowed = atol + rtol * np.abs(d)
            ok = (a == d) | (np.isnan(a) & np.isnan(d)) | (np.isfinite(a) & np.isfinite(d) & (diff <= allowed))
    else:
        a, d = actual, desired
        ok = actual == desired
        diff = allowed = None
    if ok.all():
        return None
    bad = np.argwhere(~ok)
    first = tuple(int(i) for i in bad[0])
    total, count = ok.size, int((~ok).sum())
    lines = [f"values differ: {count} of {total} elements ({100.0 * count / total:.3g}%)"
             + (f" beyond rtol={rtol:g}, atol={atol:g}" if diff is not None else "")]
    if diff is None:
        lines.append(f"first at {name(first)}: actual {a[first]!r}, desired {d[first]!r}")
    else:
        sa, sd = _fmt_pair(a[first], d[first])
        lines.append(f"first at {name(first)}: actual {sa}, desired {sd}, "
                     f"|diff| {_fmt(diff[first], 4)} > allowed {_fmt(allowed[first], 4)}")
        finite_bad = np.where(~ok & np.isfinite(diff), diff, -np.inf)
        if np.isfinite(finite_bad.max()):
            worst = tuple(int(i) for i in np.unravel_index(np.argmax(finite_bad), finite_bad.shape))
            if worst != first:
                sa, sd = _fmt_pair(a[worst], d[worst])
                lines.append(f"largest |diff| {_fmt(diff[worst], 4)} at {name(worst)} (actual {sa}, desired {sd})")
    return Mismatch("values", "\n".join(lines), first, float(a[first]), float(d[first]), count, total)


# -- retention ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Swap:
    """A token the candidate keeps (``kept_*``) in place of one the reference keeps (``dropped_*``)."""

    where: str
    kept_position: int
    kept_score: float
    dropped_position: int
    dropped_score: float
    gap: float
    threshold: float
    dropped_protected: bool = False

    def describe(self) -> str:
        if self.dropped_protected:
            return (f"{self.where}: candidate evicts position {self.dropped_position}, which the reference "
                    f"protects (must stay), and keeps position {self.kept_position} "
                    f"(reference score {_fmt(self.kept_score)})")
        kept, dropped = _fmt_pair(self.kept_score, self.dropped_score)
        return (f"{self.where}: candidate keeps position {self.kept_position} (reference score {kept}) "
                f"instead of position {self.dropped_position} (reference score {dropped}); |difference| "
                f"{_fmt(abs(self.gap), 4)} {'<=' if abs(self.gap) <= self.threshold else '>'} tolerance "
                f"{_fmt(self.threshold, 4)}")


@dataclass
class RetentionResult:
    """Outcome of a retention comparison: accepted ties, and the first failure if any."""

    ties: list = field(default_factory=list)
    failure: str | None = None
    swap: Swap | None = None
    head: int | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def compare_kept(actual_cols, desired_cols, scores, positions, protected, *, rtol: float, atol: float,
                 where: str) -> tuple[str, Swap | None, str | None]:
    """Compare one head's kept columns; return ``(status, swap, message)``.

    ``status`` is ``"equal"``, ``"tie"`` or ``"fail"``; ``swap`` the deciding pair (for a
    tie or a score failure); ``message`` a failure's text.
    """
    n = len(scores)
    actual_cols = np.asarray(actual_cols)
    out = actual_cols[(actual_cols < 0) | (actual_cols >= n)]
    if out.size:
        return "fail", None, f"{where}: candidate keeps column {int(out[0])}, outside [0, {n - 1}]"
    values, counts = np.unique(actual_cols, return_counts=True)
    if (counts > 1).any():
        col = int(values[counts > 1][0])
        return "fail", None, f"{where}: candidate keeps position {int(positions[col])} (column {col}) twice"
    a, d = set(actual_cols.tolist()), set(np.asarray(desired_cols).tolist())
    extra, dropped = sorted(a - d), sorted(d - a)
    if not extra and not dropped:
        return "equal", None, None
    if len(extra) != len(dropped):
        return "fail", None, (f"{where}: candidate keeps {len(a)} tokens, the reference {len(d)}")
    prot = [c for c in dropped if protected[c]]
    if prot:
        worst = min(extra, key=lambda c: (scores[c], positions[c]))
        s = Swap(where, int(positions[worst]), float(scores[worst]), int(positions[prot[0]]),
                 float(scores[prot[0]]), np.inf, 0.0, dropped_protected=True)
        return "fail", s, s.describe()
    worst_swap, worst_excess = None, -np.inf
    for dc in dropped:
        for ec in extra:
            sd, se = float(scores[dc]), float(scores[ec])
            if sd == se:
                gap = 0.0
            else:
                gap = sd - se  # nan or inf when a score is not finite: never within tolerance
            finite = [abs(v) for v in (sd, se) if np.isfinite(v)]
            threshold = atol + rtol * (max(finite) if finite else 0.0)
            excess = abs(gap) - threshold if np.isfinite(gap) else np.inf
            if worst_swap is None or excess > worst_excess:
                worst_excess = excess
                worst_swap = Swap(where, int(positions[ec]), se, int(positions[dc]), sd, gap, threshold)
    if worst_excess <= 0:
        return "tie", worst_swap, None
    return "fail", worst_swap, worst_swap.describe()


def _head_where(h: int) -> str:
    return f"head {h}"


def compare_retention(actual, desired, scores, *, positions=None, protected=None, rtol: float = 0.0,
                      atol: float = 0.0, where: Callable[[int], str] = _head_where) -> RetentionResult:
    """Tie-aware comparison of kept column indices, (Hkv, m) each, over (Hkv, n) reference scores.

    Shape and dtype (integer) are checked first. Returns every accepted tie and the first
    failing head (in head order).
    """
    actual, desired, scores = np.asarray(actual), np.asarray(desired), np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape (Hkv, n), got {scores.shape}")
    if positions is None:
        positions = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    if protected is None:
        protected = np.zeros(scores.shape, dtype=bool)
    positions, protected = np.asarray(positions), np.asarray(protected)
    for name, arr in (("positions", positions), ("protected", protected)):
        if arr.shape != scores.shape:
            raise ValueError(f"{name} must have the shape of scores {scores.shape}, got {arr.shape}")
    result = RetentionResult()
    if actual.shape != desired.shape:
        result.failure = f"shape mismatch: candidate kept {actual.shape}, reference kept {desired.shape}"
        return result
    if actual.size and actual.dtype.kind not in "iu":
        result.failure = f"dtype mismatch: kept indices must be integers, got {actual.dtype}"
        return result
    if desired.ndim != 2 or desired.shape[0] != scores.shape[0]:
        raise ValueError(f"kept must have shape (Hkv, m) with Hkv = {scores.shape[0]}, got {desired.shape}")
    for h in range(scores.shape[0]):
        status, swap, message = compare_kept(actual[h], desired[h], scores[h], positions[h], protected[h],
                                             rtol=rtol, atol=atol, where=where(h))
        if status == "tie":
            result.ties.append(swap)
        elif status == "fail":
            result.failure, result.swap, result.head = message, swap, h
            return result
    return result


# -- vector cases ---------------------------------------------------------------------------
@dataclass
class CaseResult:
    """Outcome of one vector case: ``"ok"``, ``"tie"`` (ok with accepted ties) or ``"fail"``."""

    label: str
    status: str
    messages: list = field(default_factory=list)
    ties: list = field(default_factory=list)


def _describe_position(positions: np.ndarray) -> Callable[[tuple], str]:
    def describe(index: tuple) -> str:
        if len(index) == 2:
            h, c = index
            return f"head {h}, position {int(positions[h, c])} (column {c})"
        return _default_index(index)
    return describe


def compare_case(candidate: dict, reference, *, tolerance_factor: float = 1.0, strict_ties: bool = False,
                 check_dtype="kind") -> CaseResult:
    """Compare a candidate's outputs (dict with ``kept`` and optionally ``scores``, ``protected``)
    with a reference :class:`~refkv.oracle.vectors.VectorCase`."""
    ref = reference.outputs
    rtol = reference.tolerance["rtol"] * tolerance_factor
    atol = reference.tolerance["atol"] * tolerance_factor
    positions = reference.inputs["positions"]
    result = CaseResult(reference.label, "ok")
    if "scores" in candidate:
        mm = compare_arrays(candidate["scores"], ref["scores"], rtol=rtol, atol=atol, check_dtype=check_dtype,
                            describe_index=_describe_position(positions))
        if mm:
            result.messages.append("scores: " + mm.message.replace("\n", "\n  "))
    if "protected" in candidate:
        mm = compare_arrays(candidate["protected"], ref["protected"], check_dtype=check_dtype,
                            describe_index=_describe_position(positions))
        if mm:
            result.messages.append("protected: " + mm.message.replace("\n", "\n  "))
    ret = compare_retention(candidate["kept"], ref["kept"], ref["scores"], positions=positions,
                            protected=ref["protected"], rtol=rtol, atol=atol)
    if not ret.ok:
        result.messages.append("kept: " + ret.failure)
    result.ties = ret.ties
    if strict_ties and ret.ties:
        result.messages.extend("kept (strict ties): " + t.describe() for t in ret.ties)
    if result.messages:
        result.status = "fail"
    elif result.ties:
        result.status = "tie"
    return result


# -- end to end --------------------------------------------------------------------------------
@dataclass
class EndToEndResult:
    """Outcome of an end-to-end comparison."""

    failure: str | None = None
    ties: list = field(default_factory=list)
    decisions: int = 0
    unchecked: int = 0
    logits: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None


def compare_end_to_end(candidate: dict, reference: dict, manifest: dict, *, tolerance_factor: float = 1.0,
                       strict_ties: bool = False, check_dtype="kind") -> EndToEndResult:
    """Compare a candidate's ``kept``, ``kept_count``, ``logits`` with a reference golden's arrays."""
    res = EndToEndResult()
    tol = manifest["tolerance"]
    s_rtol, s_atol = tol["scores"]["rtol"] * tolerance_factor, tol["scores"]["atol"] * tolerance_factor
    before = bool(manifest["policy"].get("evict_before_attention", False))
    counts_c, counts_r = np.asarray(candidate["kept_count"]), reference["kept_count"]
    mm = compare_arrays(counts_c, counts_r, check_dtype=False)
    if mm and mm.kind == "values":
        b, l = mm.index
        mm = Mismatch("values", f"block {b}, layer {l}: candidate holds {int(counts_c[b, l])} tokens per head, "
                                f"the reference {int(counts_r[b, l])}")
    if mm:
        res.failure = f"kept_count: {mm.message}"
        return res
    kept_c, kept_r = np.asarray(candidate["kept"]), reference["kept"]
    if kept_c.shape != kept_r.shape:
        res.failure = f"kept: shape mismatch: actual {kept_c.shape}, desired {kept_r.shape}"
        return res
    if kept_c.dtype.kind not in "iu":
        res.failure = f"kept: dtype mismatch: kept positions must be integers, got {kept_c.dtype}"
        return res

    counts = counts_r
    cand_pos, cand_n = reference["candidates"], reference["candidate_count"]
    scores, protected = reference["scores"], reference["protected"]
    n_blocks, n_layers, hkv, _ = kept_r.shape
    tie_at: list[tuple[int, int]] = []

    def tainted(b: int, l: int) -> bool:
        return any((b > tb and l >= tl) or (before and b == tb and l > tl) for tb, tl in tie_at)

    for b in range(n_blocks):
        for l in range(n_layers):
            if tainted(b, l):
                res.unchecked += 1
                continue
            res.decisions += 1
            k = int(counts[b, l])
            tie_here = False
            for h in range(hkv):
                a_pos, r_pos = kept_c[b, l, h, :k], kept_r[b, l, h, :k]
                if np.array_equal(a_pos, r_pos):
                    continue
                where = f"block {b}, layer {l}, head {h}"
                c = int(cand_n[b, l])
                if c == 0:
                    res.failure = (f"{where}: kept positions differ but the reference did not evict here "
                                   f"(candidate {_ranges(a_pos)}, reference {_ranges(r_pos)})")
                    return res
                # Tokens that arrived after an evict-before-attention decision are not
                # among its candidates; those must simply agree.
                pos_row = cand_pos[b, l, h, :c]
                in_a, in_r = np.isin(a_pos, pos_row), np.isin(r_pos, pos_row)
                if not np.array_equal(np.sort(a_pos[~in_a]), r_pos[~in_r]):
                    odd = sorted(set(a_pos[~in_a].tolist()) ^ set(r_pos[~in_r].tolist()))
                    res.failure = (f"{where}: position {odd[0]} is held by one side only and was not among "
                                   f"this eviction's candidates")
                    return res
                a_cols = np.searchsorted(pos_row, a_pos[in_a])
                r_cols = np.searchsorted(pos_row, r_pos[in_r])
                status, swap, message = compare_kept(a_cols, r_cols, scores[b, l, h, :c], pos_row,
                                                     protected[b, l, h, :c], rtol=s_rtol, atol=s_atol, where=where)
                if status == "fail":
                    res.failure = message
                    return res
                if status == "tie":
                    res.ties.append(swap)
                    tie_here = True
                    if strict_ties:
                        res.failure = "strict ties: " + swap.describe()
                        return res
            if tie_here:
                tie_at.append((b, l))

    last = n_blocks - 1
    logits_tainted = any(tb < last or (before and tb == last) for tb, _ in tie_at)
    if logits_tainted:
        res.logits = "not compared (downstream of an accepted tie)"
        return res
    lt = tol["logits"]
    mm = compare_arrays(candidate["logits"], reference["logits"], rtol=lt["rtol"] * tolerance_factor,
                        atol=lt["atol"] * tolerance_factor, check_dtype=check_dtype,
                        describe_index=lambda i: f"token id {i[0]}")
    if mm:
        res.failure = "logits: " + mm.message.replace("\n", "\n  ")
        return res
    diff = np.abs(np.asarray(candidate["logits"], dtype=np.float64) - reference["logits"].astype(np.float64))
    res.logits = f"max |diff| {_fmt(diff.max()) if diff.size else 0}"
    return res


def _ranges(positions) -> str:
    from ..formatting import format_ranges

    return format_ranges(np.asarray(positions))


# -- files and suites ---------------------------------------------------------------------------
@dataclass
class FileReport:
    """Outcome of one golden file: ``status`` is ``"ok"``, ``"tie"``, ``"fail"`` or ``"missing"``."""

    path: str
    kind: str
    status: str
    summary: str = ""
    failures: list = field(default_factory=list)
    ties: list = field(default_factory=list)


def check_vector_file(candidate_path, reference_path, *, tolerance_factor: float = 1.0,
                      strict_ties: bool = False, check_dtype="kind", rel: str | None = None,
                      dtype: str | None = None, default_params_only: bool = False) -> FileReport:
    """Compare a candidate vectors file with the reference one, case by case (matched by id).

    ``dtype`` and ``default_params_only`` select the reference cases compared (for a
    float32-only kernel, or one without a policy's optional variants); the others are
    not compared even if the candidate has them.
    """
    from ..policies import get
    from .vectors import json_params, read_vectors

    rel = rel or str(reference_path)
    ref = read_vectors(reference_path)
    cand = read_vectors(candidate_path, candidate=True)
    all_ids = {c.id for c in ref.cases}
    if dtype is not None or default_params_only:
        defaults = json_params(get(ref.policy).params()) if default_params_only else None
        ref = replace(ref, cases=[c for c in ref.cases if (dtype is None or c.dtype == dtype)
                                  and (defaults is None or c.params == defaults)])
    report = FileReport(rel, "vectors", "ok")
    if cand.policy != ref.policy:
        report.status = "fail"
        report.failures.append(f"candidate file is for policy {cand.policy!r}, the reference for {ref.policy!r}")
        return report
    by_id = {c.id: c for c in cand.cases}
    n_fail = n_tie = 0
    for case in ref.cases:
        if case.id not in by_id:
            report.failures.append(f"{case.label}: missing from the candidate")
            n_fail += 1
            continue
        res = compare_case(by_id[case.id].outputs, case, tolerance_factor=tolerance_factor,
                           strict_ties=strict_ties, check_dtype=check_dtype)
        if res.status == "fail":
            n_fail += 1
            report.failures.append(f"{res.label}:\n    " + "\n    ".join(m.replace("\n", "\n    ")
                                                                         for m in res.messages))
        elif res.status == "tie":
            n_tie += 1
            report.ties.extend(f"{res.label}: {t.describe()}" for t in res.ties)
    unknown = sorted(set(by_id) - all_ids)
    if unknown:
        report.failures.append(f"candidate has case ids the reference does not: {unknown}")
        n_fail += 1
    report.status = "fail" if n_fail else ("tie" if n_tie else "ok")
    report.summary = (f"{len(ref.cases)} cases: {len(ref.cases) - n_fail} passed"
                      + (f" ({n_tie} with accepted ties)" if n_tie else "") + (f", {n_fail} failed" if n_fail else ""))
    return report


def check_end_to_end_file(candidate_path, reference_path, *, tolerance_factor: float = 1.0,
                          strict_ties: bool = False, check_dtype="kind", rel: str | None = None) -> FileReport:
    """Compare a candidate end-to-end golden with the reference one."""
    from .endtoend import read_end_to_end

    rel = rel or str(reference_path)
    ref = read_end_to_end(reference_path)
    cand = read_end_to_end(candidate_path, candidate=True)
    res = compare_end_to_end(cand.arrays, ref.arrays, ref.manifest, tolerance_factor=tolerance_factor,
                             strict_ties=strict_ties, check_dtype=check_dtype)
    report = FileReport(rel, "e2e", "ok")
    head = f"{ref.label}: {res.decisions} (block, layer) steps compared"
    if res.unchecked:
        head += f", {res.unchecked} downstream of a tie not compared"
    report.summary = head + (f"; logits {res.logits}" if res.logits else "")
    if res.failure:
        report.status = "fail"
        report.failures.append(res.failure)
    elif res.ties:
        report.status = "tie"
    report.ties = [t.describe() for t in res.ties]
    return report


@dataclass
class SuiteReport:
    """Outcome of :func:`check_suite`."""

    candidate: str
    reference: str
    files: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(f.status in ("ok", "tie") for f in self.files)

    def counts(self) -> dict:
        out = {"ok": 0, "tie": 0, "fail": 0, "missing": 0}
        for f in self.files:
            out[f.status] += 1
        return out

    def format(self, *, verbose: bool = False) -> str:
        """The report as text: failures in full, ties listed, passing files one line each."""
        lines = [f"refkv golden check: {self.candidate} against {self.reference}"]
        tags = {"ok": "ok  ", "tie": "TIE ", "fail": "FAIL", "missing": "MISS"}
        for f in self.files:
            if f.status == "ok" and not verbose:
                continue
            lines.append(f"{tags[f.status]} {f.path}" + (f": {f.summary}" if f.summary else ""))
            for msg in f.failures:
                lines.append("     " + msg.replace("\n", "\n     "))
            for t in f.ties[:5 if not verbose else None]:
                lines.append("     tie accepted: " + t)
            if len(f.ties) > 5 and not verbose:
                lines.append(f"     ... {len(f.ties) - 5} more ties (--verbose lists them)")
        c = self.counts()
        n_ties = sum(len(f.ties) for f in self.files)
        n = len(self.files)
        ties = f" ({c['tie']} with {n_ties} accepted ties)" if n_ties else ""
        lines.append(f"{n} file{'s' if n != 1 else ''}: {c['ok'] + c['tie']} passed{ties}, {c['fail']} failed, "
                     f"{c['missing']} missing; {self.seconds:.2f} s")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def check_suite(candidate_dir, reference_dir, *, policies: Sequence[str] | None = None,
                kinds: Sequence[str] = ("vectors", "e2e"), allow_missing: bool = False,
                tolerance_factor: float = 1.0, strict_ties: bool = False, check_dtype="kind",
                dtype: str | None = None, default_params_only: bool = False) -> SuiteReport:
    """Compare every file of a candidate directory with the reference suite.

    The candidate directory mirrors the reference's layout (``vectors/<policy>.json``,
    ``e2e/<policy>/<setting>.json`` + ``.npz``), each file holding the candidate's outputs
    in the same schema. A file the candidate lacks fails, unless ``allow_missing``.
    ``dtype`` limits the check to cases and end-to-end goldens of that dtype;
    ``default_params_only`` to cases with the policies' default parameters (end-to-end
    goldens always use them).
    """
    import time

    from .suite import read_suite

    start = time.perf_counter()
    candidate_dir, reference_dir = Path(candidate_dir), Path(reference_dir)
    if not candidate_dir.is_dir():
        raise ValueError(f"candidate directory {candidate_dir} does not exist")
    if tolerance_factor <= 0:
        raise ValueError(f"tolerance_factor must be > 0, got {tolerance_factor!r}")
    suite = read_suite(reference_dir)
    unknown = sorted(set(policies or ()) - set(suite["policies"]))
    if unknown:
        raise ValueError(f"the reference suite has no policy {', '.join(map(repr, unknown))}; it has: "
                         f"{', '.join(suite['policies'])}")
    if dtype not in (None, "float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    report = SuiteReport(str(candidate_dir), str(reference_dir))
    for entry in suite["files"]:
        if entry["kind"] not in kinds or (policies and entry["policy"] not in policies):
            continue
        if dtype is not None and entry["kind"] == "e2e" and entry.get("dtype", dtype) != dtype:
            continue
        rel = entry["path"]
        cand = candidate_dir / rel
        if not cand.exists():
            if not allow_missing:
                report.files.append(FileReport(rel, entry["kind"], "missing", "the candidate has no such file"))
            continue
        options = {"tolerance_factor": tolerance_factor, "strict_ties": strict_ties, "check_dtype": check_dtype,
                   "rel": rel}
        try:
            if entry["kind"] == "vectors":
                result = check_vector_file(cand, reference_dir / rel, dtype=dtype,
                                           default_params_only=default_params_only, **options)
            else:
                result = check_end_to_end_file(cand, reference_dir / rel, **options)
            report.files.append(result)
        except ValueError as err:  # a malformed candidate file is a failure of that file
            report.files.append(FileReport(rel, entry["kind"], "fail", failures=[f"unreadable: {err}"]))
    report.seconds = time.perf_counter() - start
    return report
