"""Schedule checks on the candidate's own state (issue 33 A): every decision judged, whatever came before it."""

import numpy as np
import pytest
from test_oracle_schedule import LateKeyDiff  # a defect from the second compression on

from refkv import Engine, policies
from refkv.cache import EMPTY
from refkv.model import builtin_model
from refkv.oracle.models import decode_tokens, prompt_tokens
from refkv.oracle.ownstate import query_rows, unjudgeable
from refkv.oracle.recorder import run_schedule_golden
from refkv.oracle.rounds import compare_schedule
from refkv.policies.keydiff import KeyDiff
from refkv.schedule import Schedule, run_schedule

SCHED = Schedule(None, None, 4, 16, new_tokens=12)   # one-shot prompt of 24, then 3 rounds every 4 tokens to 16


@pytest.fixture(scope="module")
def keydiff_golden():
    return run_schedule_golden(policies.get("keydiff"), SCHED)


def candidate(policy, sched=SCHED, dtype="float64", permute=False, prompt_length=24):
    """refkv run as a candidate that records its own state at every round (what the adapter records)."""
    model = builtin_model(seed=0, dtype=np.dtype(dtype))
    engine = Engine(model, policy, record="views")
    prompt = prompt_tokens(1, prompt_length, model.config.vocab_size)
    new = decode_tokens(2, sched.new_tokens, model.config.vocab_size)
    rng = np.random.default_rng(5)
    rounds = []
    w = query_rows(policy)

    def on_step(step, rnd):
        if rnd is None:
            return
        events = {e.layer: e.view for e in engine.trace.evictions if e.block == step}
        per = []
        for layer, c in enumerate(engine.caches):
            view = events.get(layer)
            if view is None:   # nothing evicted: the state is what the layer holds
                pos, k, v, q = c.positions_or(-1), c.keys.copy(), c.values.copy(), None
            else:
                pos = np.where(view.positions == EMPTY, -1, view.positions)
                k, v, q = view.keys, view.values, (view.queries[:, -w:] if w else None)
            order = rng.permutation(c.positions.shape[1]) if permute else np.arange(c.positions.shape[1])
            per.append((c.positions_or(-1)[:, order], c.keys[:, order], c.values[:, order], pos, k, v, q))
        rounds.append(per)

    engine.trace.kept.clear()
    logits, _ = run_schedule(engine, prompt, new, sched, on_step=on_step)
    def padded(i, fill, dtype_):
        width = max(p[i].shape[1] for r in rounds for p in r)
        shape = (len(rounds), len(rounds[0]), rounds[0][0][i].shape[0], width, *rounds[0][0][i].shape[2:])
        out = np.full(shape, fill, dtype=dtype_)
        for r, per in enumerate(rounds):
            for layer, entry in enumerate(per):
                out[r, layer, :, :entry[i].shape[1]] = entry[i]
        return out

    cand = {"kept": padded(0, -1, np.int64), "kept_count": np.array([[p[0].shape[1] for p in per] for per in rounds]),
            "row_keys": padded(1, 0.0, np.float64), "row_values": padded(2, 0.0, np.float64), "logits": logits,
            "state_positions": padded(3, -1, np.int64), "state_keys": padded(4, 0.0, np.float64),
            "state_values": padded(5, 0.0, np.float64)}
    if w:
        q0 = next(p[6] for per in rounds for p in per if p[6] is not None)
        q = np.zeros((len(rounds), len(rounds[0]), q0.shape[0], w, q0.shape[2]))
        for r, per in enumerate(rounds):
            for layer, p in enumerate(per):
                if p[6] is not None:
                    q[r, layer, :, -p[6].shape[1]:] = p[6]
        cand["state_queries"] = q
    return cand


def test_refkv_itself_is_judged_on_its_own_state_in_every_round(keydiff_golden):
    m, a = keydiff_golden
    for permute in (False, True):
        res = compare_schedule(candidate(policies.get("keydiff"), permute=permute), a, m)
        assert res.ok, res.failure
        assert res.form == "every round, on the candidate's own state"
        assert [r["judged"] for r in res.per_round] == [4, 4, 4] and res.decisions == 12 and res.unchecked == 0
        assert [r["evicting"] for r in res.per_round] == [4, 4, 4]
        assert res.logits.startswith("max |diff|")


def test_a_divergence_leaves_no_later_round_unjudged(keydiff_golden):
    """On the reference's trajectory round 2 would be 'downstream' of round 1; on its own state it is judged."""
    m, a = keydiff_golden
    res = compare_schedule(candidate(LateKeyDiff()), a, m)
    assert not res.ok and res.first_round == 1 and res.unchecked == 0
    assert {d.round for d in res.divergences} == {1, 2}
    assert res.failure.startswith("first diverged at round 1 (decode step 8, 32 tokens seen, budget 16): "
                                  "kept-set difference beyond ties")


class TieThenLate(KeyDiff):
    """Round 0: the boundary pair swapped (a near tie at bfloat16's rounding); round 2: the oldest tokens kept."""

    calls: dict

    def keep_indices(self, view):
        self.calls = getattr(self, "calls", {})
        self.calls[view.layer] = self.calls.get(view.layer, 0) + 1
        call = self.calls[view.layer]
        if call == 3:
            return np.sort(np.argsort(view.positions, axis=1)[:, :view.keep], axis=1)
        kept = super().keep_indices(view)
        if call == 1 and view.layer == 0:
            s = self.score(view)
            kept = kept.copy()
            out = np.setdiff1d(np.arange(view.n), kept[0])
            worst_in = kept[0][np.argmin(s[0, kept[0]])]
            best_out = out[np.argmax(s[0, out])]
            kept[0] = np.sort(np.append(kept[0][kept[0] != worst_in], best_out))
        return kept


def test_after_an_accepted_tie_the_candidates_own_branch_is_judged(keydiff_golden):
    m, a = keydiff_golden
    res = compare_schedule(candidate(TieThenLate()), a, m, dtype="bfloat16")
    assert not res.ok, "the defect at round 2 must be found after the tie at round 0"
    assert res.first_round == 2 and res.unchecked == 0
    assert res.per_round[0]["ties"] >= 1 and res.ties[0].where.startswith("round 0, layer 0, head 0")


def test_the_same_tie_is_refused_at_float64(keydiff_golden):
    m, a = keydiff_golden
    res = compare_schedule(candidate(TieThenLate()), a, m)
    assert not res.ok and res.first_round == 0


class RandomKeyDiff(KeyDiff):
    def score(self, view):
        return np.random.default_rng(view.layer + 100 * view.n).random(view.positions.shape)


def test_random_scores_fail_at_bfloat16_and_float16(keydiff_golden):
    m, a = keydiff_golden
    cand = candidate(RandomKeyDiff())
    for dtype in ("bfloat16", "float16", "float32"):
        res = compare_schedule(cand, a, m, dtype=dtype)
        assert not res.ok and res.first_round == 0, dtype


def test_a_state_that_does_not_continue_the_previous_round_fails(keydiff_golden):
    m, a = keydiff_golden
    cand = candidate(policies.get("keydiff"))
    evicted = sorted(set(cand["state_positions"][0, 2, 0].tolist()) - set(cand["kept"][0, 2, 0].tolist()))[0]
    pos = cand["state_positions"][1, 2, 0]
    pos[pos == cand["kept"][0, 2, 0, 3]] = evicted        # a kept position vanished, an evicted one came back
    res = compare_schedule(cand, a, m)
    assert not res.ok and res.divergences[0].kind == "state does not continue the previous round"
    assert f"it also holds {evicted}" in res.failure and "it lacks" in res.failure


def test_every_single_row_holding_a_wrong_key_is_caught(keydiff_golden):
    """Compared bit for bit with the candidate's own state: no projection to blur two close keys."""
    m, a = keydiff_golden
    base = candidate(policies.get("keydiff"), dtype="float32")
    caught = total = 0
    for i in range(16):
        for j in range(16):
            if i == j:
                continue
            cand = {k: v.copy() for k, v in base.items()}
            cand["row_keys"][1, 2, 1, i] = cand["row_keys"][1, 2, 1, j]
            res = compare_schedule(cand, a, m, dtype="bfloat16")
            total += 1
            caught += (not res.ok) and any(d.kind == "row holds the wrong key" for d in res.divergences)
    assert caught == total == 240


def test_declared_rescaled_scores_are_compared_rescaled(keydiff_golden):
    m, a = keydiff_golden
    cand = candidate(policies.get("keydiff"))
    cand["scores"] = 3.0 * a["scores"]
    cand["score_positions"] = a["candidates"]
    res = compare_schedule(cand, a, m, declare={"scores": "positive_multiple"})
    assert res.ok, res.failure
    assert res.scores_checked == int((a["candidates"] >= 0).sum())
    cand["scores"] = 3.0 * a["scores"] + np.random.default_rng(0).normal(size=a["scores"].shape)
    res = compare_schedule(cand, a, m, declare={"scores": "positive_multiple"})
    assert not res.ok and "score beyond tolerance" in res.failure and "positive_multiple" in res.failure
    # the same without the state: compared against the reference's scores, rescaled too
    for name in ("state_positions", "state_keys", "state_values"):
        del cand[name]
    res = compare_schedule(cand, a, m, declare={"scores": "positive_multiple"})
    assert not res.ok and "positive_multiple" in res.failure and res.scores_checked > 0


def test_without_state_the_report_says_what_it_can_miss(keydiff_golden):
    m, a = keydiff_golden
    cand = candidate(policies.get("keydiff"))
    for name in ("state_positions", "state_keys", "state_values"):
        del cand[name]
    res = compare_schedule(cand, a, m, dtype="bfloat16")
    assert res.ok and res.form == "every round"
    note = next(n for n in res.notes if n.startswith("warning: decisions compared with the reference's"))
    assert "the candidate gives no state" in note and "a score error up to about" in note


def test_snapkv_is_judged_on_its_queries():
    sched = Schedule(None, 20, 4, 16, new_tokens=8)
    policy = policies.get("snapkv", window=4)
    m, a = run_schedule_golden(policy, sched)
    cand = candidate(policy, sched)
    assert cand["state_queries"].shape[3] == 4
    res = compare_schedule(cand, a, m)
    assert res.ok and res.form.endswith("own state"), res.failure
    cand["state_queries"] = cand["state_queries"][..., ::-1, :]  # the window's queries in the wrong order
    res = compare_schedule(cand, a, m)
    assert not res.ok


@pytest.mark.parametrize("name, why", [
    ("h2o", "keeps per-token state"), ("hashevict", "evicts before attention"), ("mat", "evicts before attention"),
    ("scissorhands", "keeps per-token state"), ("expected_attention", "reads the step's queries"),
])
def test_what_cannot_be_judged_on_own_state_says_why(name, why):
    assert why in unjudgeable(policies.get(name), builtin_model().config)


@pytest.mark.parametrize("name", ["keydiff", "knorm", "sink", "tova", "snapkv", "pyramidkv", "adakv"])
def test_stateless_policies_are_judged_on_own_state(name):
    assert unjudgeable(policies.get(name), builtin_model().config) is None


# -- policies with per-token state: the candidate's tokens replayed -------------------------------------------
def tokens_candidate(policy, sched, monkeypatch, dtype="float64", prompt_length=24):
    """refkv run as a candidate that records every token's query, key and value at every layer."""
    import refkv.engine as engine_module

    seen: dict = {}
    original = engine_module.layer_step

    def spy(policy_, cache, q, k, v, *, layer, **kw):
        seen.setdefault(layer, []).append((q.copy(), k.copy(), v.copy()))
        return original(policy_, cache, q, k, v, layer=layer, **kw)

    monkeypatch.setattr(engine_module, "layer_step", spy)
    cand = candidate(policy, sched, dtype=dtype, prompt_length=prompt_length)
    monkeypatch.undo()
    for name in ("state_positions", "state_keys", "state_values", "state_queries"):
        cand.pop(name, None)
    layers = sorted(seen)
    cand["token_queries"] = np.stack([np.concatenate([q for q, _, _ in seen[l]], axis=1) for l in layers])
    cand["token_keys"] = np.stack([np.concatenate([k for _, k, _ in seen[l]], axis=1) for l in layers])
    cand["token_values"] = np.stack([np.concatenate([v for _, _, v in seen[l]], axis=1) for l in layers])
    return cand


STATEFUL = {
    "h2o": (lambda: policies.get("h2o", recent=2), SCHED),
    "scissorhands": (lambda: policies.get("scissorhands"), SCHED),
    "hashevict": (lambda: policies.get("hashevict"), Schedule(8, 16, 4, 16, new_tokens=12)),
    "mat": (lambda: policies.get("mat"), Schedule(8, 16, 4, 16, new_tokens=12)),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_a_policy_with_per_token_state_is_replayed_from_the_candidates_tokens(name, monkeypatch):
    make, sched = STATEFUL[name]
    m, a = run_schedule_golden(make(), sched)
    cand = tokens_candidate(make(), sched, monkeypatch)
    res = compare_schedule(cand, a, m)
    assert res.ok, res.failure
    assert res.form == "every round, on the candidate's own state (its tokens replayed)"
    assert res.decisions == a["kept"].shape[0] * a["kept"].shape[1] and res.unchecked == 0
    # the same candidate in float32 arithmetic passes at float32's rounding
    res = compare_schedule(tokens_candidate(make(), sched, monkeypatch, dtype="float32"), a, m, dtype="float32")
    assert res.ok, res.failure


class LateH2O(policies.policy_class("h2o")):
    """H2O whose decisions from the second round on keep the newest tokens (the heavy hitters go)."""

    def score(self, view):
        s = super().score(view)
        return s if int(view.query_positions[-1]) < 28 else view.positions.astype(np.float64)


def test_a_late_defect_of_a_stateful_policy_is_found_in_every_later_round(monkeypatch):
    m, a = run_schedule_golden(policies.get("h2o", recent=2), SCHED)
    res = compare_schedule(tokens_candidate(LateH2O(recent=2), SCHED, monkeypatch), a, m)
    assert not res.ok and res.first_round == 1 and res.unchecked == 0
    assert {d.round for d in res.divergences} == {1, 2}


def test_a_kept_position_the_candidate_never_held_fails_and_names_it(monkeypatch):
    m, a = run_schedule_golden(policies.get("h2o", recent=2), SCHED)
    cand = tokens_candidate(policies.get("h2o", recent=2), SCHED, monkeypatch)
    gone = sorted(set(range(24)) - set(cand["kept"][0, 1, 0].tolist()))[0]   # evicted at round 0
    cand["kept"][1, 1, 0, 0] = gone
    res = compare_schedule(cand, a, m)
    assert not res.ok and res.first_round == 1
    assert f"keeps position {gone} after round 1, which its own cache did not hold" in res.failure


def test_a_replayed_row_holding_another_tokens_key_fails(monkeypatch):
    m, a = run_schedule_golden(policies.get("h2o", recent=2), SCHED)
    cand = tokens_candidate(policies.get("h2o", recent=2), SCHED, monkeypatch)
    cand["row_keys"][2, 3, 1, 4] = cand["row_keys"][2, 3, 1, 5]
    res = compare_schedule(cand, a, m)
    assert not res.ok and any(d.kind == "row holds the wrong key" and d.round == 2 for d in res.divergences)


def test_the_first_divergence_names_the_layers_own_budget():
    sched = Schedule(None, 40, 4, 40, new_tokens=0)
    policy = policies.get("pyramidkv", beta=2)
    m, a = run_schedule_golden(policy, sched, prompt_length=48)
    budgets = policy.layer_budgets(40, 4)
    assert len(set(budgets)) > 1
    cand = {"kept": a["kept"].copy(), "kept_count": a["kept_count"], "logits": a["logits"]}
    row = cand["kept"][0, 3, 0]
    gone = sorted(set(range(48)) - set(row.tolist()))[0]
    row[np.argmin(np.where(row >= 0, row, 10**6))] = gone   # keeps an evicted token for its oldest
    res = compare_schedule(cand, a, m)
    assert not res.ok
    assert f"budget {budgets[3]} in layer 3 (N = 40)" in res.failure.splitlines()[0]


def test_a_state_whose_rows_moved_between_rounds_fails(keydiff_golden):
    """The state of round 1 holds the keys of two retained positions swapped: the cache moved rows between
    compressions, so the decision it shows was made on a cache the candidate did not keep."""
    m, a = keydiff_golden
    cand = candidate(policies.get("keydiff"))
    pos, keys = cand["state_positions"][1, 2, 0], cand["state_keys"][1, 2, 0]
    p, q = cand["kept"][0, 2, 0, 3], cand["kept"][0, 2, 0, 7]
    i, j = int(np.flatnonzero(pos == p)[0]), int(np.flatnonzero(pos == q)[0])
    keys[[i, j]] = keys[[j, i]]
    res = compare_schedule(cand, a, m)
    assert not res.ok and res.divergences[0].kind == "state does not continue the previous round"
    assert f"its key of position {p} is not the key row" in res.failure
