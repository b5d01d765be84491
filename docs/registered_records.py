"""Phase one's regenerated records, checked against the values its verdicts were computed from.

Phase one's perplexity, attention-loss and geometry records were not committed and were lost
(deviation 8 of ``docs/guide/registration.rst``). A part rerun on the commit that first ran it
(``51af84e``, the same machine) is committed as
``_static/experiments/registered/records/NAME.jsonl.gz``. This script recomputes, from those
records alone, every per-prompt value of that part's claims by the registered rule
(:mod:`refkv.experiments.registered`) and compares each with ``units.csv``, the table the
published verdicts were computed from (``tests/experiments/test_experiment_registered_prompts.py``
recomputes them from it). It writes into ``_static/experiments/registered/``:

* ``regenerated.csv``: one row per comparison of a regenerated part: the prompts in
  ``units.csv`` and in the records, how many values were compared, how many agree bit for bit,
  and the largest relative difference;
* ``g1_all.csv``, once the geometry records are there: G1's all-queries statistic, the display
  the registration promised beside G1 (:func:`refkv.experiments.registered.g1_all_queries`):
  n prompts, the mean, its 95% t interval and the two-sided p. It is a display, not a verdict;
* ``seeds.csv``: HashEvict's per-seed values, per text the value under each registered hash
  seed and their mean, the value the claim's test used: A1's mean attention loss (from the
  attention-loss records) and H1's perplexity (from the perplexity records);
* ``bootstrap.csv``, once the perplexity records are there: the registered sensitivity display
  of every perplexity claim, the two-stage bootstrap (texts, then 64-token blocks within a text;
  10,000 resamples) beside the t interval, seed 0's interval and the range of each end over 20
  bootstrap seeds (:func:`refkv.experiments.phase2_analysis.document_bootstrap`, each text its
  own document, HashEvict's seeds averaged within a text as its per-text value is). No verdict
  uses it;
* ``mat_selection.csv``, once the perplexity records are there: MAT's choice re-derived, every
  spec of its grid with its mean per-text perplexity on the 4 selection texts, the spec the
  registered rule chooses (:func:`refkv.experiments.registered.chosen_mat`) and the one
  ``choices.csv`` published;
* ``distinctiveness.csv``, from the committed passkey test records (``passkey-test.jsonl``):
  another promised display, per test prompt the needle's distinctiveness by KeyDiff's score
  (the full cache's record: the fraction of the prompt's tokens scoring below the needle's,
  mean over layers and KV heads) beside whether each setting answered.

Run::

    python docs/registered_records.py            # rewrite the CSVs from the records
    python docs/registered_records.py --check    # write nothing; exit 1 if one differs

and ``tests/experiments/test_registered_records.py`` runs the check.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from refkv.experiments.phase2_analysis import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEEDS,
    document_bootstrap,
    read_gzip_records,
)
from refkv.experiments.records import read_records
from refkv.experiments.registered import (
    REGISTERED_HASHEVICT,
    attention_loss_comparisons,
    chosen_mat,
    g1_all_queries,
    geometry_comparisons,
    mat_selection,
    perplexity_comparisons,
    perplexity_token_losses,
    step_losses,
    unit_rows,
)
from refkv.experiments.stats import paired_t_test
from refkv.experiments.tables import csv_text
from refkv.files import OutputFolder, read_regular

HERE = Path(__file__).resolve().parent
OUT = HERE / "_static" / "experiments" / "registered"
RECORDS = OUT / "records"
UNITS = OUT / "units.csv"
CHOICES = OUT / "choices.csv"
PASSKEY = RECORDS / "passkey-test.jsonl"
#: Phase one's parts that can be regenerated, and the comparisons each feeds.
PARTS = {"perplexity": perplexity_comparisons, "attention_loss": attention_loss_comparisons,
         "geometry": geometry_comparisons}
MAX_UNITS_BYTES = 1 << 20
REGENERATED_COLUMNS = ["part", "claim", "a", "b", "units_published", "units_regenerated", "values_compared",
                       "values_identical", "max_relative_difference"]
G1_ALL_COLUMNS = ["claim", "a", "n", "unit", "estimate", "low", "high", "p"]
SEED_COLUMNS = ["claim", "text", "segment", "seed=0", "seed=1", "seed=2", "mean"]
BOOTSTRAP_COLUMNS = ["claim", "a", "b", "texts", "estimate", "t_low", "t_high", "low", "high", "low_min",
                     "low_max", "high_min", "high_max", "seeds", "resamples"]
MAT_COLUMNS = ["spec", "texts", "mean_ppl", "chosen", "published"]
#: The registered passkey settings, in the verdict table's order.
SETTINGS = ["keydiff@blocks", "snapkv@blocks", "tova@blocks", "h2o@blocks",
            "keydiff@oneshot", "snapkv@oneshot", "tova@oneshot", "h2o@oneshot"]
DISTINCTIVENESS_COLUMNS = ["sample", "source", "depth", "distinctiveness", "full", *SETTINGS]


def published_units(path: Path = UNITS) -> dict[tuple, dict]:
    """``units.csv``'s rows by (claim, a, b, unit), as the verdict script wrote them."""
    text = read_regular(path, MAX_UNITS_BYTES, what="units table").decode("utf-8")
    return {(r["claim"], r["a"], r["b"], r["unit"]): r for r in csv.DictReader(io.StringIO(text))}


def _relative(x: str, y: str) -> float:
    a, b = float(x), float(y)
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))


def agreement(part: str, records: list[dict], published: dict[tuple, dict]) -> list[dict]:
    """Per comparison of ``part``: how the values recomputed from ``records`` agree with ``published``."""
    rows = {}
    for row in unit_rows(PARTS[part](records)):
        key = (row["claim"], row["a"], row["b"] or "")
        out = rows.setdefault(key, {"part": part, "claim": key[0], "a": key[1], "b": key[2], "units_regenerated": 0,
                                    "values_compared": 0, "values_identical": 0, "max_relative_difference": 0.0})
        out["units_regenerated"] += 1
        old = published.get((*key, row["unit"]))
        if old is None:
            raise ValueError(f"{part}: the records hold {key} on {row['unit']}, which units.csv does not")
        for column in ("value_a", "value_b", "value_full"):
            if (row[column] is None) != (old[column] == ""):
                raise ValueError(f"{part}: {key} {row['unit']} {column} is given on one side only")
            if row[column] is None:
                continue
            out["values_compared"] += 1
            out["values_identical"] += row[column] == old[column]      # repr: equal text is equal bits
            out["max_relative_difference"] = max(out["max_relative_difference"], _relative(row[column], old[column]))
    for key, out in rows.items():
        out["units_published"] = sum(k[:3] == key for k in published)
    return list(rows.values())


def g1_all_row(records: list[dict]) -> dict | None:
    """G1-all's display row (None without 2 prompts)."""
    comparison = g1_all_queries(records)
    if comparison is None:
        return None
    interval, p = paired_t_test(comparison.a_values, [0.0] * len(comparison.a_values))
    return {"claim": comparison.claim, "a": comparison.a, "n": len(comparison.a_values), "unit": comparison.unit,
            "estimate": interval.estimate, "low": interval.low, "high": interval.high, "p": p}


def seed_rows(claim: str, per_seed: dict[str, dict[tuple, float]]) -> list[dict]:
    """Per registered verdict text with every seed of ``per_seed`` (``{"hashevict:seed=S":
    {(text, segment): value}}``): each seed's value and their mean, the text's value in the
    claim's test."""
    from refkv.experiments.perplexity import registered_texts

    seeds = REGISTERED_HASHEVICT
    rows = []
    for text, segment in registered_texts("verdict"):
        if all((text, segment) in per_seed.get(s, {}) for s in seeds):
            values = [per_seed[s][(text, segment)] for s in seeds]
            rows.append({"claim": claim, "text": text, "segment": segment,
                         **{s.removeprefix("hashevict:"): v for s, v in zip(seeds, values)},
                         "mean": sum(values) / len(values)})
    return rows


def perplexity_seeds(records: list[dict]) -> dict[str, dict[tuple, float]]:
    """H1's per-seed values: ``{"hashevict:seed=S": {(text, segment): ppl}}`` of the registered
    token-by-token (``B = 1``) HashEvict cells that ran."""
    out: dict[str, dict[tuple, float]] = {}
    for r in records:
        p = r["params"]
        if (p.get("design") == "registered" and p["policy"] in REGISTERED_HASHEVICT and p["block"] == 1
                and "skipped" not in r["result"]):
            out.setdefault(p["policy"], {})[(p["text"], p["segment"])] = r["result"]["ppl"]
    return out


def bootstrap_rows(records: list[dict], *, n_boot: int = BOOTSTRAP_RESAMPLES,
                   seeds: int = BOOTSTRAP_SEEDS) -> list[dict]:
    """The registered two-stage bootstrap of every perplexity comparison the records give: seed
    0's interval, and the range of each end over ``seeds`` bootstrap seeds, beside the t interval."""
    rows = []
    for comparison in perplexity_comparisons(records):
        arrays = perplexity_token_losses(records, comparison)     # (runs, texts, 1, tokens) each
        draws = [document_bootstrap(*arrays, n_boot=n_boot, seed=s) for s in range(seeds)]
        interval, _ = paired_t_test(comparison.a_values, comparison.b_values)
        rows.append({"claim": comparison.claim, "a": comparison.a, "b": comparison.b,
                     "texts": len(comparison.a_values), "estimate": draws[0].estimate,
                     "t_low": interval.low, "t_high": interval.high, "low": draws[0].low, "high": draws[0].high,
                     "low_min": min(d.low for d in draws), "low_max": max(d.low for d in draws),
                     "high_min": min(d.high for d in draws), "high_max": max(d.high for d in draws),
                     "seeds": seeds, "resamples": n_boot})
    return rows


def mat_rows(records: list[dict], published: str | None) -> list[dict]:
    """MAT's selection table: each spec's mean per-text perplexity on the selection texts, whether
    the registered rule chooses it, and whether ``choices.csv`` names it (``published``)."""
    chosen = chosen_mat(records)
    return [{"spec": spec, "texts": texts, "mean_ppl": mean, "chosen": spec == chosen, "published": spec == published}
            for spec, (mean, texts) in sorted(mat_selection(records).items(), key=lambda item: (item[1][0], item[0]))]


def published_mat(path: Path = CHOICES) -> str | None:
    """The MAT spec ``choices.csv`` names (None where it names none)."""
    text = read_regular(path, MAX_UNITS_BYTES, what="choices table").decode("utf-8")
    rows = list(csv.DictReader(io.StringIO(text)))
    if len(rows) != 1 or "mat_spec" not in rows[0]:
        raise ValueError(f"{path}: expected one row with a mat_spec column")
    return rows[0]["mat_spec"] or None


def distinctiveness_rows(records: list[dict]) -> list[dict]:
    """Per registered test prompt: the needle's distinctiveness (from the full cache's record) and
    whether the full cache and each setting of :data:`SETTINGS` answered."""
    prompts: dict[int, dict] = {}
    for r in records:
        p, result = r["params"], r["result"]
        if p.get("design") != "registered" or p.get("purpose") != "test" or "correct" not in result:
            continue
        row = prompts.setdefault(p["sample"], {"sample": p["sample"]})
        if p["policy"] == "full":
            row.update(source=result["source"], depth=result["depth"], full=bool(result["correct"]),
                       distinctiveness=result.get("needle_distinctiveness"))
        else:
            row[f"{p['policy']}@{'oneshot' if p['block'] is None else 'blocks'}"] = bool(result["correct"])
    return [prompts[k] for k in sorted(prompts)]


def table_files(records: Path = RECORDS, units: Path = UNITS, passkey: Path = PASSKEY, choices: Path = CHOICES, *,
                n_boot: int = BOOTSTRAP_RESAMPLES, seeds: int = BOOTSTRAP_SEEDS) -> dict[str, str]:
    """The CSVs, computed from the ``NAME.jsonl.gz`` files of ``records``, the published ``units``
    and ``choices`` and the passkey test's records (a missing ``passkey`` file: no
    distinctiveness table); ``n_boot`` and ``seeds`` are the bootstrap display's."""
    published = published_units(units)
    rows, g1_all, files, seed_table = [], None, {}, []
    for part in PARTS:
        path = records / f"{part}.jsonl.gz"
        if not path.is_file():
            continue
        found = read_gzip_records(path)
        try:
            rows += agreement(part, found, published)
            if part == "geometry":
                g1_all = g1_all_row(found)
            if part == "attention_loss":
                seed_table += seed_rows("A1", step_losses(found))
            if part == "perplexity":
                seed_table += seed_rows("H1", perplexity_seeds(found))
                files["bootstrap.csv"] = csv_text(bootstrap_rows(found, n_boot=n_boot, seeds=seeds), BOOTSTRAP_COLUMNS)
                files["mat_selection.csv"] = csv_text(mat_rows(found, published_mat(choices)), MAT_COLUMNS)
        except (KeyError, TypeError) as err:   # a record without a field the rule reads, or of another type
            raise ValueError(f"{path}: a record lacks or mistypes a field the rule reads ({err!r})") from None
    if not rows:
        raise ValueError(f"{records}: none of {', '.join(f'{p}.jsonl.gz' for p in PARTS)}; nothing to compare")
    files["regenerated.csv"] = csv_text(rows, REGENERATED_COLUMNS)
    if seed_table:
        files["seeds.csv"] = csv_text(seed_table, SEED_COLUMNS)
    if g1_all is not None:
        files["g1_all.csv"] = csv_text([g1_all], G1_ALL_COLUMNS)
    try:
        prompts = distinctiveness_rows(read_records(passkey))
    except (KeyError, TypeError) as err:
        raise ValueError(f"{passkey}: a record lacks or mistypes a field the display reads ({err!r})") from None
    if prompts:
        files["distinctiveness.csv"] = csv_text(prompts, DISTINCTIVENESS_COLUMNS)
    return files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docs/registered_records.py", description=__doc__.splitlines()[0])
    parser.add_argument("--records", default=str(RECORDS), metavar="DIR",
                        help=f"the folder of the regenerated *.jsonl.gz records (default {RECORDS})")
    parser.add_argument("--units", default=str(UNITS), metavar="CSV", help=f"the published units (default {UNITS})")
    parser.add_argument("--passkey", default=str(PASSKEY), metavar="JSONL",
                        help=f"the passkey test's records (default {PASSKEY})")
    parser.add_argument("--choices", default=str(CHOICES), metavar="CSV",
                        help=f"the published choices, MAT's spec among them (default {CHOICES})")
    parser.add_argument("--out", default=str(OUT), metavar="DIR", help=f"where the CSVs go (default {OUT})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each CSV that differs from what would be written")
    args = parser.parse_args(argv)  # unknown arguments: exit 2
    try:
        folder = OutputFolder(args.out, what="--out", inputs=[args.records, args.units, args.passkey, args.choices])
        files = table_files(Path(args.records), Path(args.units), Path(args.passkey), Path(args.choices))
    except ValueError as err:
        parser.error(str(err))
    stale = folder.publish(files, check=args.check)
    if args.check:
        for name in stale:
            print(f"differs: {folder.path(name)}")
        print(f"{len(stale)} of {len(files)} files differ")
        return 1 if stale else 0
    table = list(csv.DictReader(io.StringIO(files["regenerated.csv"])))
    same = sum(int(r["values_identical"]) for r in table)
    total = sum(int(r["values_compared"]) for r in table)
    print(f"{same} of {total} published values recomputed bit for bit from the regenerated records "
          f"-> {args.out} ({len(stale)} files changed)")
    if "mat_selection.csv" in files:
        mat = list(csv.DictReader(io.StringIO(files["mat_selection.csv"])))
        chosen = [r["spec"] for r in mat if r["chosen"] == "True"]
        published = [r["spec"] for r in mat if r["published"] == "True"]
        print(f"MAT's choice from the records: {chosen[0] if chosen else 'none'}; choices.csv: "
              f"{published[0] if published else 'not among the records'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
