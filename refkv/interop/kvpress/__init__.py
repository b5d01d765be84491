"""Check an NVIDIA kvpress press against refkv's schedule goldens, end to end.

A kvpress developer checks a press in a few lines::

    from kvpress import DecodingPress, KeyDiffPress
    from refkv.interop.kvpress import check, write_candidates

    # goldens made once with: refkv golden generate --out goldens --policies keydiff
    write_candidates(DecodingPress(KeyDiffPress()), "goldens", "candidate", policy="keydiff")
    report = check("candidate", "goldens", policy="keydiff")  # or: refkv golden check candidate --against goldens
    print(report.format())
    assert report.ok

:func:`write_candidates` finds the policy's schedule goldens (:mod:`refkv.schedule`) that
the press can run, fits the press to each golden's schedule and policy options
(:func:`fit_press`: the compression interval, target size or ratio, the prefill ratio that
keeps the golden's prefill budget, and every option the press exposes that the golden states
-- window, kernel, beta, n_sink, the AdaKV safeguard; a golden whose options the press
computes otherwise and cannot set is skipped, saying why), builds the golden's model in
``transformers`` from refkv's weights (:func:`hf_model`), feeds the golden's prompt and then
its decoding tokens one at a time inside the press's context, and records after every round,
per layer and KV head, which **position each cache row holds**, the rows' keys and values,
and the press's scores where its scorer exposes them. The candidate files mirror the
goldens' paths, so ``refkv golden check`` reads them, or :func:`check` (the same check,
returning its report).

Which position a row holds is found without trusting the press: after each step every
row's key and value are matched bit for bit against the rows the layer held just before
the press compressed it (a forward hook registered before the press's own), since presses
gather rows unchanged; a row whose key changed (``KeyRerotationPress`` re-rotates keys) is
matched by its value alone. A row that matches nothing is written as position -1, which
the check reports.

Schedules a press can run (others are skipped, with the reason):

* ``DecodingPress``: prefill one-shot and not compressed, ``rule="interval"``;
* ``CompressionRatioDecodingPress``: the same with ``rule="ratio"``;
* ``PrefillDecodingPress``: one-shot prefill compressed to the golden's prefill budget
  (its prefilling press's ``compression_ratio`` is set to keep exactly that many), then
  its decoding press as above;
* a press without decoding (any ``ScorerPress`` and prefill wrappers): one-shot prefill
  with a budget and no decoding rounds.

The package, by concern: :mod:`~refkv.interop.kvpress.models` (refkv's weights in
``transformers``), :mod:`~refkv.interop.kvpress.schedules` (fitting a press to a schedule
golden and running it), :mod:`~refkv.interop.kvpress.rows` (which position each cache row
holds), :mod:`~refkv.interop.kvpress.cases` (one decision on refkv's vector cases),
:mod:`~refkv.interop.kvpress.outcomes` (kvpress's defects the cases expose, the docs
table), :mod:`~refkv.interop.kvpress.catalog` (every kvpress press and its status) and
:mod:`~refkv.interop.kvpress.amplification` (the measurement behind the bfloat16 and
float16 end-to-end tolerances).
"""

from .models import hf_model
from .schedules import Skip, check, fit_press, kvpress_version, run_press, write_candidates

__all__ = ["Skip", "check", "fit_press", "hf_model", "kvpress_version", "run_press", "write_candidates"]
