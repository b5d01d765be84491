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

GQA (``tiny``: 4 query heads, 2 KV heads): SnapKV, PyramidKV and Ada-KV's codes select per
*query* head (their models repeat the KV heads first); their candidates name the model
``tiny-kv-repeated`` (:func:`refkv.model.heads.repeat_kv_heads`), where refkv's authors' form
decides per query head too. Their KV-head paths (KVCache-Factory's ``kv_head`` layout, Ada-KV's
``gqa_support``) name ``tiny`` and refkv's ``gqa_agg``. The GQA tests below show that neither
regime is the other and that the check tells them apart.
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
            # a row names its own repository when it is not the policy's (KVCache-Factory's SnapKVCluster)
            assert manifest["source"]["commit"] == row["commit"] and len(row["commit"]) == 40
            assert manifest["source"]["repository"] == row.get("repository", obj["repository"])
            assert manifest["policy"]["params"]["form"] == "authors"
            assert manifest["model"]["builder"] == row["model"]


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


# -- GQA ------------------------------------------------------------------------------------------------
GQA_POLICIES = ("adakv", "pyramidkv", "snapkv")


def _rows(policy: str) -> list[dict]:
    return json.loads((HERE / policy / "PROVENANCE.json").read_text())["configurations"]


def _gqa_agg(manifest: dict) -> str | None:
    params = manifest["policy"]["params"]
    return (params.get("base_params") or {}).get("gqa_agg") if "base_params" in params else params.get("gqa_agg")


@pytest.mark.parametrize("policy", GQA_POLICIES)
def test_gqa_configurations_are_committed_in_both_regimes(policy):
    """Per query head on the repeated model and per KV head on the GQA one, several budgets, windows
    and both poolings; every average-pooling configuration identical (max pooling: exact ties)."""
    rows = [r for r in _rows(policy) if r["gqa"]]
    query = [r for r in rows if r["regime"] == "query"]
    kv_head = [r for r in rows if r["regime"].startswith("kvhead-")]
    assert len(query) >= 3 and len(kv_head) >= 3, policy
    for group, model in ((query, "tiny-kv-repeated"), (kv_head, "tiny")):
        assert {r["model"] for r in group} == {model}
        assert {r["pooling"] for r in group} == {"avg", "max"}
        assert len({(r["budget"], r["window"]) for r in group}) >= 2
    assert len({r["gqa_agg"] for r in kv_head}) >= 2
    for row in rows:
        manifest = json.loads((HERE / policy / Path(row["file"]).name).read_text())
        assert _gqa_agg(manifest) == row["gqa_agg"]
        config = manifest["model"]["config"]
        assert config["n_kv_heads"] == (config["n_heads"] if row["regime"] == "query" else config["n_heads"] // 2)
        if row["pooling"] == "avg":
            assert row["identical"], row["configuration"]
    assert not any(r["gqa"] for r in _rows(policy) if r["model"] == "tiny-mha")


def test_repeated_builder_is_tiny_with_its_kv_heads_repeated():
    """The golden builder ``tiny-kv-repeated`` is refkv.model.heads.repeat_kv_heads of ``tiny``."""
    tiny, wide = build_model("tiny", 0, "float64"), build_model("tiny-kv-repeated", 0, "float64")
    assert (wide.config.n_heads, wide.config.n_kv_heads) == (tiny.config.n_heads, tiny.config.n_heads)
    g = tiny.config.n_heads // tiny.config.n_kv_heads
    d = tiny.config.d_head
    for narrow, broad in zip(tiny.weights.layers, wide.weights.layers):
        for name in ("wk", "wv"):
            heads = getattr(narrow, name).reshape(-1, tiny.config.n_kv_heads, d)
            np.testing.assert_array_equal(getattr(broad, name).reshape(-1, tiny.config.n_heads, d),
                                          np.repeat(heads, g, axis=1))


@pytest.mark.parametrize("policy", GQA_POLICIES)
def test_per_query_head_is_not_one_set_per_kv_head(policy, tmp_path):
    """The authors' per-query-head sets (read from the candidates) split inside a KV head's group:
    no single set per KV head -- refkv's paper form on the GQA model, repeated to the query heads --
    reproduces them, so the repeated model is needed and is not a formality."""
    for row in (r for r in _rows(policy) if r["regime"] == "query" and r["pooling"] == "avg"):
        candidate = HERE / policy / Path(row["file"]).name
        manifest, cand = (lambda d: (d.manifest, d.arrays["kept"]))(read_end_to_end(candidate, candidate=True))
        config = manifest["model"]["config"]
        grouped = cand.reshape(*cand.shape[:2], 2, config["n_heads"] // 2, cand.shape[-1])  # (R, L, Hkv, g, N)
        split = int(np.any(grouped != grouped[:, :, :, :1], axis=(-1, -2)).sum())
        assert split > 0, row["configuration"]
        assert f"in {split} of" in row["note"]
        params = manifest["policy"]["params"]
        paper = ({k: v for k, v in params.items() if k != "form"} if policy == "snapkv"
                 else {**params, "form": "paper"})
        _, arrays = run_schedule_golden(policies.get(policy, **paper), Schedule.from_dict(manifest["schedule"]),
                                        dtype=manifest["dtype"], prompt_length=manifest["prompt"]["length"],
                                        model="tiny", built=build_model("tiny", 0, manifest["dtype"]))
        per_kv_head = np.repeat(arrays["kept"], 2, axis=2)[..., :cand.shape[-1]]  # (R, L, H, N)
        assert not np.array_equal(per_kv_head, cand), row["configuration"]


@pytest.mark.parametrize("policy", GQA_POLICIES)
def test_the_check_fails_the_other_group_reduction_and_the_paper_form(policy, tmp_path, capsys):
    """A KV-head candidate of the group max judged against refkv with the group mean, and against
    the paper form: ``refkv golden check`` fails both (the reduction decides which tokens stay)."""
    row = next(r for r in _rows(policy) if r["gqa_agg"] == "max" and r["pooling"] == "avg")
    candidate = HERE / policy / Path(row["file"]).name
    params = read_end_to_end(candidate, candidate=True).manifest["policy"]["params"]
    if policy == "snapkv":
        wrong = {"mean": {**params, "gqa_agg": "mean"},
                 "paper": {k: v for k, v in params.items() if k not in ("form", "gqa_agg")}}
    else:
        base = {k: v for k, v in params["base_params"].items() if k != "gqa_agg"}
        wrong = {"mean": {**params, "base_params": {**params["base_params"], "gqa_agg": "mean"}},
                 "paper": {**params, "form": "paper", "base_params": base}}
    alone = tmp_path / "candidate"
    alone.mkdir()
    for suffix in (".json", ".npz"):
        (alone / candidate.with_suffix(suffix).name).write_bytes(candidate.with_suffix(suffix).read_bytes())
    right = _reference(candidate, tmp_path / "right")
    assert main(["golden", "check", str(alone), "--against", str(right.parent), "--strict-ties"]) == 0
    for name, p in wrong.items():
        _reference(candidate, tmp_path / name, p)
        capsys.readouterr()
        rc = main(["golden", "check", str(alone), "--against", str(tmp_path / name)])
        assert rc != 0, (name, capsys.readouterr().out)


def test_snapkv_authors_form_refuses_a_gqa_cache_and_names_the_repeated_model():
    from refkv.engine import Engine

    engine = Engine(build_model("tiny", 0, "float32"), policies.get("snapkv", window=4, kernel=3, form="authors"), 16)
    with pytest.raises(ValueError, match=r"refkv\.model\.heads\.repeat_kv_heads.*gqa_agg"):
        engine.forward(np.arange(40) % 50)
    with pytest.raises(ValueError, match="gqa_agg is a parameter of form='authors'"):
        policies.get("snapkv", gqa_agg="mean")
    with pytest.raises(ValueError, match="gqa_agg must be one of"):
        policies.get("snapkv", form="authors", gqa_agg="median")
    with pytest.raises(ValueError, match="gqa_func"):  # the Ada-KV code accepts max and mean only
        policies.get("adakv", form="authors", base_params={"window": 4, "gqa_agg": "sum"})



def test_group_reduce_by_hand_and_a_default_left_out_of_the_manifest():
    from refkv.policies.snapkv import group_reduce

    sums = np.array([[1.0, 4.0], [3.0, 2.0], [5.0, 0.5], [1.0, 0.5]], dtype=np.float32)  # (H=4, n=2), g=2
    np.testing.assert_array_equal(group_reduce(sums, 2, "mean"), [[2.0, 3.0], [3.0, 0.5]])
    np.testing.assert_array_equal(group_reduce(sums, 2, "max"), [[3.0, 4.0], [5.0, 0.5]])
    np.testing.assert_array_equal(group_reduce(sums, 2, "sum"), [[4.0, 6.0], [6.0, 1.0]])
    assert group_reduce(sums, 2, "mean").dtype == np.float32
    # goldens written before gqa_agg existed list every parameter: the default must not appear
    assert "gqa_agg" not in policies.get("snapkv", form="authors").params()
    assert policies.get("snapkv", form="authors", gqa_agg="max").params()["gqa_agg"] == "max"


def test_snapkv_paper_form_is_the_kv_head_mean_path_with_average_pooling(tmp_path, capsys):
    """refkv's group mean (the paper form) keeps what KVCache-Factory's kv_head path with
    ``gqa_score_agg='mean'`` keeps, and on one query head per KV head what the SnapKV code keeps,
    with average pooling (the committed candidates; the float32 softmax changes no decision here)."""
    rows = [r for r in _rows("snapkv") if r["pooling"] == "avg" and r["regime"] in ("mha", "kvhead-mean")]
    assert {r["regime"] for r in rows} == {"mha", "kvhead-mean"}
    alone = tmp_path / "candidates"
    alone.mkdir()
    for row in rows:
        candidate = HERE / "snapkv" / Path(row["file"]).name
        params = read_end_to_end(candidate, candidate=True).manifest["policy"]["params"]
        _reference(candidate, tmp_path / "paper", {k: v for k, v in params.items() if k not in ("form", "gqa_agg")})
        for suffix in (".json", ".npz"):
            (alone / candidate.with_suffix(suffix).name).write_bytes(candidate.with_suffix(suffix).read_bytes())
    rc = main(["golden", "check", str(alone), "--against", str(tmp_path / "paper"), "--strict-ties"])
    out = capsys.readouterr().out
    assert rc == 0 and re.search(rf"\b{len(rows)} files?: {len(rows)} passed", out), out
