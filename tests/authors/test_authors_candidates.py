"""refkv's ``form="authors"`` against the authors' own code, with no network and no checkout.

``tools/authors/run_authors.py`` loaded the authors' selection code unmodified from their
repositories (the commit is in each folder's ``PROVENANCE.json``), ran it on refkv's inputs
and wrote what it kept as candidate goldens (the files beside this test), and refkv's own
goldens of the same runs (``reference/<policy>/``: what a backend porting the authors' code
checks itself against). Here refkv regenerates each reference with its authors' form (it
must equal the committed one) and ``refkv golden check`` compares: every round, every
layer, ties strict except where ``torch.topk``'s order of equal values decides. A second
test shows the check can fail: the paper form of HashEvict (hashing the key, refkv's tie
rule and window) is judged against the same candidates.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from refkv import policies
from refkv.cli import main
from refkv.model import TINY, Model, random_weights
from refkv.oracle.endtoend import read_end_to_end, write_end_to_end
from refkv.oracle.models import build_model
from refkv.oracle.recorder import run_schedule_golden
from refkv.schedule import Schedule

HERE = Path(__file__).parent
#: The four policies run by tools/authors/run_authors.py (the others' harness, tools/authors/<policy>.py,
#: writes its own provenance and is checked by tests/authors/test_authors_<policy>.py).
PROVENANCE = sorted(HERE / name / "PROVENANCE.json" for name in ("adakv", "hashevict", "pyramidkv", "snapkv"))


def _model(name: str, dtype: str) -> Model:
    if name == "tiny-mha":  # the tiny model with one KV head per query head (no GQA)
        config = replace(TINY, n_kv_heads=TINY.n_heads, name="tiny-mha")
        return Model(config, random_weights(config, seed=0, dtype=dtype))
    return build_model(name, 0, dtype)


def _reference(candidate: Path, folder: Path, params: dict | None = None) -> Path:
    """Regenerate, with refkv, the golden a candidate answers (its manifest names the run)."""
    manifest = read_end_to_end(candidate, candidate=True).manifest
    policy = policies.get(manifest["policy"]["name"], **(params or manifest["policy"]["params"]))
    model = _model(manifest["model"]["builder"], manifest["dtype"])
    ref, arrays = run_schedule_golden(policy, Schedule.from_dict(manifest["schedule"]), dtype=manifest["dtype"],
                                      prompt_length=manifest["prompt"]["length"], model=manifest["model"]["builder"],
                                      built=model)
    folder.mkdir(parents=True, exist_ok=True)
    write_end_to_end(folder / candidate.name, ref, arrays)
    return folder / candidate.name


def test_provenance_names_a_commit_and_every_candidate():
    assert PROVENANCE, "no committed candidates"
    for path in PROVENANCE:
        obj = json.loads(path.read_text())
        assert len(obj["commit"]) == 40 and obj["loaded_unmodified"] is True
        files = sorted(p.name for p in path.parent.glob("*.json") if p.name != "PROVENANCE.json")
        rows = [row for row in obj["configurations"] if row["file"]]  # a GQA row of SnapKV has no candidate
        assert files == sorted(Path(row["file"]).name for row in rows)
        for row in rows:
            manifest = json.loads((path.parent / Path(row["file"]).name).read_text())
            assert manifest["source"]["commit"] == obj["commit"]
            assert manifest["policy"]["params"]["form"] == "authors"


#: Candidates whose exact ties the check accepts: ``torch.topk`` orders equal values by no stable
#: rule (max pooling makes plateaus of equal scores), so refkv keeps its own tie rule
#: there; every other candidate is checked with ties strict.
TIES_ACCEPTED = {"snapkv": "-max-", "pyramidkv": "-max-", "adakv": "-max-"}


@pytest.mark.parametrize("provenance", PROVENANCE, ids=lambda p: p.parent.name)
def test_authors_code_keeps_what_refkv_authors_form_keeps(provenance, tmp_path, capsys):
    """Every configuration the authors' code ran: the same kept sets at every round and layer."""
    policy = provenance.parent.name
    candidates = sorted(p for p in provenance.parent.glob("*.json") if p.name != "PROVENANCE.json")
    for candidate in candidates:
        fresh = read_end_to_end(_reference(candidate, tmp_path / "all")).arrays
        committed = read_end_to_end(HERE / "reference" / policy / candidate.name).arrays
        for name in ("kept", "kept_count", "candidates", "protected"):  # the committed reference is refkv's today
            np.testing.assert_array_equal(fresh[name], committed[name], err_msg=f"{candidate.name}: {name}")
        strict = tmp_path / ("loose" if TIES_ACCEPTED.get(policy, "\0") in candidate.name else "strict")
        strict.mkdir(exist_ok=True)
        for suffix in (".json", ".npz"):
            (strict / candidate.with_suffix(suffix).name).write_bytes(candidate.with_suffix(suffix).read_bytes())
    for group, options in (("strict", ["--strict-ties"]), ("loose", [])):
        if not (tmp_path / group).is_dir():
            continue
        count = len(list((tmp_path / group).glob("*.json")))
        rc = main(["golden", "check", str(tmp_path / group), "--against", str(tmp_path / "all"), "--allow-missing",
                   *options])
        out = capsys.readouterr().out
        assert rc == 0, out
        assert re.search(rf"\b{count} files?: {count} passed", out), out


def test_the_check_fails_the_paper_form(tmp_path):
    """The same candidates judged against the paper form (key hashing, refkv's own tie rule and
    recent window): the authors' code keeps other tokens, and the check says so."""
    folder = HERE / "hashevict"
    candidate = folder / "tiny-N16-T24-D20.json"
    params = {k: v for k, v in read_end_to_end(candidate, candidate=True).manifest["policy"]["params"].items()
              if k != "form"}
    reference = _reference(candidate, tmp_path, params)
    cand = read_end_to_end(candidate, candidate=True).arrays["kept"]
    assert not np.array_equal(cand, read_end_to_end(reference).arrays["kept"])
    assert main(["golden", "check", str(folder), "--against", str(tmp_path), "--allow-missing"]) != 0
