"""The suite of the authors' forms, ``tests/golden-authors``: every ``form="authors"`` in its regime.

refkv passes it (its runs regenerated and checked), the authors' own code passes it (the
candidates ``tools/authors`` wrote from their unmodified code, committed in ``tests/authors/``),
and the paper form fails it where the two forms keep different tokens, so the goldens can fail.
"""

import json
import pathlib
import shutil

import pytest

from refkv import policies
from refkv.cli import main
from refkv.oracle import check_suite, generate_suite, read_suite, read_vectors
from refkv.oracle.endtoend import write_end_to_end
from refkv.oracle.recipes import AUTHORS_REGIMES, MODEL_SEED
from refkv.oracle.recorder import run_end_to_end, run_schedule_golden
from refkv.oracle.regenerate import REGENERATION_BOUND, regeneration_differences
from refkv.oracle.specs import authors_regime, authors_specs, spec_name, spec_tag
from refkv.policies.base import policy_forms
from refkv.policies.spec import make_policy
from refkv.schedule import Schedule
from refkv.testing import assert_case

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden-authors"
AUTHORS = ROOT / "tests" / "authors"
PAGE = ROOT / "docs" / "oracle" / "authors.rst"
REGENERATE = "regenerate with: refkv golden generate --out tests/golden-authors --authors-forms"


def _manifests():
    for entry in read_suite(GOLDEN)["files"]:
        if entry["kind"] == "e2e":
            yield entry, json.loads((GOLDEN / entry["path"]).read_text())


def test_every_authors_form_has_vector_end_to_end_and_schedule_goldens():
    index = read_suite(GOLDEN)  # every checksum verified
    listed = {e["path"] for e in index["files"]}
    assert listed == {p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*.json")} - {"suite.json"}
    assert index["policies"] == sorted(authors_specs(), key=lambda s: index["policies"].index(s))
    assert set(index["policies"]) == set(authors_specs()), REGENERATE
    # every policy whose form parameter takes "authors" has its regime (a new one cannot be forgotten);
    # knorm's and sink's authors' code keeps what their paper form keeps: no parameter, no suite of their own
    with_form = {name for name in policies.available() if "authors" in policy_forms(policies.policy_class(name))
                 and "form" in policies.policy_class(name).__dataclass_fields__}
    assert with_form == set(AUTHORS_REGIMES) == {"adakv", "h2o", "hashevict", "pyramidkv", "snapkv", "tova"}
    for spec in index["policies"]:
        kinds = {("vectors" if e["kind"] == "vectors" else "schedule" if e["mode"] == "schedule" else "e2e")
                 for e in index["files"] if e["policy"] == spec}
        assert kinds == {"vectors", "e2e", "schedule"}, spec
    assert 1_000_000 < sum(f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file()) < 1_600_000


def test_every_authors_golden_keeps_to_its_regime():
    for entry, manifest in _manifests():
        regime = authors_regime(entry["policy"])
        config = manifest["model"]["config"]
        assert manifest["policy"]["params"]["form"] == "authors", entry["path"]
        assert manifest["model"]["builder"] == regime.model, entry["path"]
        assert (config["n_kv_heads"] == config["n_heads"]) == (regime.model == "tiny-mha"), entry["path"]
        if "oneshot" in regime.modes and "block" not in regime.modes:  # the prompt compressed once, one-shot
            assert manifest["block_size"] is None or manifest["schedule"]["block_size"] is None, entry["path"]
    for path in sorted((GOLDEN / "vectors").glob("*.json")):
        doc = read_vectors(path)
        regime = AUTHORS_REGIMES[doc.policy]
        for case in doc.cases:
            assert case.params["form"] == "authors" and case.mode in regime.modes, case.label
            assert not regime.mha or case.sizes["n_heads"] == case.sizes["n_kv_heads"], case.label


def test_refkv_passes_its_authors_goldens(tmp_path, capsys):
    """Each end-to-end and schedule golden run again by refkv and checked as a candidate: every decision."""
    for entry, manifest in _manifests():
        policy = make_policy(entry["policy"])
        common = {"dtype": manifest["dtype"], "prompt_length": manifest["prompt"]["length"],
                  "model_seed": MODEL_SEED, "model": manifest["model"]["builder"]}
        if entry["mode"] == "schedule":
            m, a = run_schedule_golden(policy, Schedule.from_dict(manifest["schedule"]), **common)
        else:
            m, a = run_end_to_end(policy, budget=manifest["budget"], block_size=manifest["block_size"], **common)
        write_end_to_end(tmp_path / entry["path"], m, a)
    n_e2e = sum(1 for _ in _manifests())
    assert main(["golden", "check", str(tmp_path), "--against", str(GOLDEN), "--kind", "e2e", "--strict-ties"]) == 0
    assert f"{n_e2e} files: {n_e2e} passed" in capsys.readouterr().out
    n_cases = 0
    for path in sorted((GOLDEN / "vectors").glob("*.json")):  # refkv's policy on each case's own inputs
        for case in read_vectors(path).cases:
            policy, view = case.policy(), case.view()
            kept = policy.keep_indices(view)
            kept = kept if not isinstance(kept, list) else [list(row) for row in kept]
            assert_case(case, scores=policy.score(view), protected=policy.protected(view), kept=kept,
                        strict_ties=True)
            n_cases += 1
    assert n_cases == sum(e.get("cases", 0) for e in read_suite(GOLDEN)["files"])


@pytest.mark.slow
def test_regenerating_the_authors_suite_gives_the_same_decisions(tmp_path):
    generate_suite(tmp_path, authors_specs())
    diff = regeneration_differences(GOLDEN, tmp_path)
    assert not diff.decisions, "\n".join(diff.decisions[:20]) + f"\n{REGENERATE}"
    assert not diff.beyond(REGENERATION_BOUND), REGENERATE


#: The candidates tools/authors wrote by running the authors' unmodified code (tests/authors/<policy>/,
#: their commit in PROVENANCE.json), and the golden of the same run in the authors' suite.
AUTHORS_CANDIDATES = {
    "snapkv/mha-N40-w32-k7-max-T64": "tiny-mha-sched-oneshot40-prefill-only-float64",
    "adakv/N16-w4-k3-avg-a0.2-T40": "tiny-mha-sched-oneshot16-prefill-only-float64",
    "pyramidkv/N16-w4-k3-avg-b20-T40": "tiny-mha-sched-oneshot16-prefill-only-float64",
    "hashevict/tiny-N16-T24-D20": "sched-oneshot-K1-N16-float64",
}


def _place(candidate: pathlib.Path, folder: pathlib.Path, label: str) -> None:
    """Copy a candidate (its JSON names its arrays' file) to ``folder/label.json`` + ``.npz``."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(candidate.read_text())
    manifest["arrays"]["file"] = f"{label}.npz"
    (folder / f"{label}.json").write_text(json.dumps(manifest))
    shutil.copy(candidate.with_suffix(".npz"), folder / f"{label}.npz")


def test_the_authors_own_code_passes_the_authors_goldens(tmp_path, capsys):
    """The committed candidates of the authors' code are the same runs as these goldens, and pass them."""
    specs = {spec_name(s): s for s in authors_specs()}
    for source, label in AUTHORS_CANDIDATES.items():
        policy = source.split("/")[0]
        candidate = AUTHORS / f"{source}.json"
        assert json.loads(candidate.read_text())["source"]["commit"]  # written by the authors' code
        _place(candidate, tmp_path / "e2e" / spec_tag(specs[policy]), label)
    code = main(["golden", "check", str(tmp_path), "--against", str(GOLDEN), "--kind", "e2e", "--allow-missing"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{len(AUTHORS_CANDIDATES)} files: {len(AUTHORS_CANDIDATES)} passed" in out


#: Authors' forms whose paper form keeps other tokens in the regime's golden, and the golden: PyramidKV's
#: floored schedule keeps more, Ada-KV's allocation mixes in the uniform one, HashEvict's authors' code cuts
#: the prompt and protects one more recent token.
PAPER_DIFFERS = {
    "pyramidkv": "tiny-mha-sched-oneshot16-prefill-only-float64",
    "adakv": "tiny-mha-sched-oneshot16-prefill-only-float64",
    "hashevict": "sched-oneshot-K1-N16-float64",
}


@pytest.mark.parametrize("name", list(PAPER_DIFFERS))
def test_the_paper_form_fails_the_authors_golden(name, tmp_path, capsys):
    spec = next(s for s in authors_specs() if spec_name(s) == name)
    rel = f"e2e/{spec_tag(spec)}/{PAPER_DIFFERS[name]}.json"
    manifest = json.loads((GOLDEN / rel).read_text())
    params = {**manifest["policy"]["params"], "form": "paper"}
    if name != "hashevict":
        params["base_params"] = {k: v for k, v in params["base_params"].items() if k != "form"}
    m, a = run_schedule_golden(policies.get(name, **params), Schedule.from_dict(manifest["schedule"]),
                               dtype="float64", prompt_length=manifest["prompt"]["length"],
                               model=manifest["model"]["builder"])
    write_end_to_end(tmp_path / rel, m, a)
    assert main(["golden", "check", str(tmp_path), "--against", str(GOLDEN), "--kind", "e2e", "--allow-missing"]) == 1
    out = capsys.readouterr().out
    assert "FAIL " + rel in out and "first diverged at round 0" in out, out
    # ... and the authors' form passes the same golden (the failure is the form's)
    m, a = run_schedule_golden(make_policy(spec), Schedule.from_dict(manifest["schedule"]), dtype="float64",
                               prompt_length=manifest["prompt"]["length"], model=manifest["model"]["builder"])
    write_end_to_end(tmp_path / rel, m, a)
    assert check_suite(tmp_path, GOLDEN, kinds=("e2e",), allow_missing=True).ok


def test_authors_forms_and_policies_exclude_each_other(tmp_path, capsys):
    assert main(["golden", "generate", "--out", str(tmp_path / "x"), "--authors-forms", "--policies", "tova"]) == 2
    assert "--authors-forms and --policies exclude each other" in capsys.readouterr().err
    assert main(["golden", "generate", "--out", str(tmp_path / "x"), "--authors-forms", "--budget", "8"]) == 2
    assert "no schedule options" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# -- the docs page's table ------------------------------------------------------------------------------------
def table_rst() -> str:
    """The table of docs/oracle/authors.rst: each authors' form, its regime and its goldens."""
    index = read_suite(GOLDEN)
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - policy (spec)", "     - regime",
             "     - vector cases", "     - end-to-end", "     - schedule"]
    for spec in index["policies"]:
        regime = authors_regime(spec)
        files = [e for e in index["files"] if e["policy"] == spec]
        cases = sum(e["cases"] for e in files if e["kind"] == "vectors")
        e2e = [pathlib.PurePath(e["path"]).stem for e in files if e["kind"] == "e2e" and e["mode"] != "schedule"]
        sched = [pathlib.PurePath(e["path"]).stem for e in files if e.get("mode") == "schedule"]
        lines += [f"   * - ``{spec}``", f"     - {regime.words}", f"     - {cases}",
                  f"     - {', '.join(f'``{n}``' for n in e2e)}", f"     - {', '.join(f'``{n}``' for n in sched)}"]
    return "\n".join(lines) + "\n"


def test_docs_table_lists_the_authors_goldens():
    page = PAGE.read_text()
    begin, end = ".. begin-authors-table\n", ".. end-authors-table\n"
    shown = page[page.index(begin) + len(begin):page.index(end)].strip("\n")
    assert shown == table_rst().strip("\n"), "docs/oracle/authors.rst's table is stale; paste:\n" + table_rst()
