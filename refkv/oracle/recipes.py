"""What a golden suite holds: the recipes of its vector cases and the settings of its end-to-end
and schedule goldens.

Every policy refkv registers is included (:func:`library_policies`: the registry's
policies whose class lives in the ``refkv`` package, so a test module or a plugin that
registers its own does not change the suite), and a new policy is picked up by the next
``refkv golden generate``. Nothing here names a policy: :data:`VARIANTS`, the extra
parameter sets that widen the coverage of policies with options, are the policy classes'
``variants``.

Two regimes are covered (a case's ``mode``): **one-shot** (the whole prompt is one block:
full square causal attention over all ``T`` tokens, then one eviction to ``N``; what
kvpress and most GPU backends do at prefill) and **block** prompt processing (blocks of
``B`` tokens, the last block full, ``B = 1`` being token generation).

:mod:`refkv.oracle.goldens` builds one policy's goldens from these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import policies as policy_registry
from ..schedule import Schedule

__all__ = ["BUDGETS", "E2E_MODELS", "E2E_SETTINGS", "ONESHOT_SETTINGS", "RECIPES", "SCHEDULE_SETTINGS", "VARIANTS",
           "Recipe", "ScheduleSetting", "Setting", "library_policies"]

#: ``check`` accepts (small budgets make small files).
BUDGETS = (6, 8, 12, 16, 24, 40)

#: Extra parameter sets per policy (beyond the defaults), with a reduced set of recipes: each
#: policy class's ``variants``.
#: A set a policy rejects (ValueError/TypeError) is skipped and listed.
VARIANTS: dict[str, list[dict]] = {
    name: [dict(v) for v in policy_registry.policy_class(name).card.variants]
    for name in policy_registry.available() if policy_registry.policy_class(name).card.variants}


#: Meta-policies whose defaults run over SnapKV's default window of 32 (so their cases need
#: ``N = 40`` and repeat the size of SnapKV's own): their default parameter set takes only the
#: block recipes marked ``variants`` and the engine captures (a one-shot case of ``T = 46``
#: is 117 kB of attention weights), so the suite stays small; their variants over small
#: windows carry the one-shot cases and the default's one-shot run is an end-to-end golden.
REDUCED_DEFAULTS = ("adakv", "pyramidkv")


@dataclass(frozen=True)
class Recipe:
    """How to build one synthetic vector case.

    ``block=None`` is **one-shot**: ``T = N + extra`` tokens (or ``tokens`` if given) in one
    block. Otherwise **block** mode: ``T`` is the smallest multiple of ``block`` that
    reaches ``N``, plus ``1 + extra`` more blocks, so every block is full and earlier
    blocks evict too; ``no_eviction`` uses the largest multiple of ``block`` within ``N``.
    ``edit`` plants an adversarial feature. The case's comment states the ``T``, ``B`` and
    ``N`` it ran with.
    """

    comment: str
    dtype: str = "float64"
    n_heads: int = 4
    n_kv_heads: int = 2
    d_head: int = 4
    block: int | None = 3
    extra: int = 1
    tokens: int | None = None
    layer: int = 3
    edit: str | None = None
    no_eviction: bool = False
    variants: bool = False  # also used for the variant parameter sets
    n_layers: int = 4
    largest_block: bool = False  # B = policy.max_block(N): only for policies that evict before attention

    @property
    def mode(self) -> str:
        return "oneshot" if self.block is None else "block"

    def n_tokens(self, budget: int) -> int:
        """``T`` for budget ``N`` (see the class docstring)."""
        if self.block is None:
            return self.tokens if self.tokens is not None else budget + self.extra
        if self.no_eviction:
            return max(self.block, budget // self.block * self.block)
        return -(-budget // self.block) * self.block + self.block * (1 + self.extra)

    def describe(self, budget: int, n_tokens: int) -> str:
        """What ran, in words: ``"one-shot: T=12 in one block, N=6"``."""
        if self.block is None:
            return f"one-shot: T={n_tokens} in one block, N={budget}"
        return f"T={n_tokens} in {n_tokens // self.block} blocks of {self.block}, N={budget}"


#: Block-mode recipes, in priority order (see :data:`MAX_VECTOR_BYTES`).
BLOCK_RECIPES = (
    Recipe("random keys, GQA, deepest layer", variants=True),
    Recipe("random keys, GQA, float32, layer 2", dtype="float32", layer=2, variants=True),
    Recipe("generation step: blocks of one token", block=1, extra=4, variants=True),
    Recipe("the largest block the policy accepts, B = max_block(N): nearest to one-shot for a policy that "
           "evicts before attention", largest_block=True, extra=0, variants=True),
    Recipe("near-duplicate key planted (near tie)", edit="near-tie"),
    Recipe("zero key planted", edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted (exact tie for key-based scores)", edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax)", edit="huge-logits", layer=2),
    Recipe("random keys, one query head per KV head, layer 0", n_heads=2, block=2, layer=0),
    Recipe("fewer tokens than the budget", no_eviction=True),
    Recipe("near-duplicate key planted (near tie), float32", dtype="float32", edit="near-tie", layer=2),
    Recipe("generation step, float32", dtype="float32", block=1, extra=2, layer=1),
)
#: One-shot recipes (kvpress's regime), in priority order; the adversarial ones in float32
#: and float64.
ONESHOT_RECIPES = (
    Recipe("random keys, GQA, deepest layer", block=None, extra=6, variants=True),
    Recipe("random keys, GQA, float32, layer 2", block=None, extra=6, dtype="float32", layer=2, variants=True),
    Recipe("near-duplicate key planted (near tie), float32", block=None, extra=6, dtype="float32",
           edit="near-tie", variants=True),
    Recipe("zero key planted, float32", block=None, extra=6, dtype="float32", edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted, float32", block=None, extra=6, dtype="float32",
           edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax), float32", block=None, extra=6, dtype="float32",
           edit="huge-logits", layer=2),
    Recipe("one query head per KV head, float32, layer 0", block=None, extra=6, dtype="float32", n_heads=2,
           layer=0),
    Recipe("a single-token prompt, float32", block=None, tokens=1, dtype="float32"),
    Recipe("near-duplicate key planted (near tie)", block=None, extra=6, edit="near-tie"),
    Recipe("zero key planted", block=None, extra=6, edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted", block=None, extra=6, edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax)", block=None, extra=6, edit="huge-logits", layer=2),
    Recipe("one query head per KV head, layer 0", block=None, extra=6, n_heads=2, layer=0),
)
RECIPES = BLOCK_RECIPES + ONESHOT_RECIPES

#: Engine captures of the default parameters, block mode: (dtype, layer, B), inserted after
#: the third block recipe.
ENGINE_CASES = (("float64", 3, 2), ("float32", 1, 2))
#: A vectors file stops taking cases of one parameter set and mode once they exceed this many
#: bytes of JSON (the first :data:`MIN_CASES` always go in). Per-token state can be large
#: (Scissorhands keeps a 400-step history per token), and so can one-shot attention weights
#: (SnapKV's default window needs ``T > 32``); the skipped cases are listed in ``suite.json``.
MAX_VECTOR_BYTES = {"block": 100_000, "oneshot": 120_000}
MIN_CASES = {"block": 4, "oneshot": 2}


@dataclass(frozen=True)
class Setting:
    """One end-to-end run: budget ``N``, block size ``B`` (None: one-shot), prompt length."""

    budget: int | None
    block_size: int | None
    prompt_length: int

    def label(self, dtype: str, model: str = "tiny") -> str:
        b = "all" if self.block_size is None else self.block_size
        prefix = "" if model == "tiny" else f"{model}-"
        return f"{prefix}N{self.budget if self.budget is not None else 'none'}-B{b}-{dtype}"


#: Block-mode end-to-end settings, tried for every policy (float64).
E2E_SETTINGS = (Setting(8, 4, 40), Setting(16, 1, 28), Setting(24, 8, 40))
#: Tried when fewer than two of :data:`E2E_SETTINGS` run (policies with large protected sets).
E2E_FALLBACK = Setting(40, 8, 64)
#: One-shot settings (B = the whole prompt), in float64 and float32: the first one the policy
#: accepts. SnapKV's default window of 32 needs ``N > 32``, hence the second.
ONESHOT_SETTINGS = (Setting(16, None, 40), Setting(40, None, 64))
#: Tried when no budgeted setting runs (``full``): the no-eviction baseline.
E2E_UNBOUNDED = Setting(None, 8, 40)
E2E_UNBOUNDED_ONESHOT = Setting(None, None, 40)

#: The models end-to-end goldens run (names of :data:`refkv.oracle.models.MODELS`): a tiny
#: model of another architecture is added to the suite with one entry here.
E2E_MODELS = ("tiny", "llama3", "qwen2", "qwen3")
#: Models other than the built-in one get the smaller set a backend of that architecture
#: needs: the first block setting and the first one-shot setting the policy accepts, in
#: float32 (the precision low-precision kernels are checked against), so the suite grows
#: by a few files per policy instead of repeating every setting.
FULL_E2E_MODEL = "tiny"

MODEL_SEED = 0
PROMPT_SEED = 1
#: Seed of the tokens fed while decoding in schedule goldens.
DECODE_SEED = 2

#: Why policies that evict before attention (HashEvict, MAT) have no one-shot cases.
NO_ONESHOT = ("no one-shot form: the policy evicts before attention (HashEvict Algorithm 1, MAT Eq. 4: the "
              "token attends over the already-evicted cache), so a block attends to at most N tokens and a "
              "block of the whole prompt (T > N) contradicts its definition; its largest block is "
              "policy.max_block(N), which a block-mode case of each parameter set uses")


def library_policies() -> list[str]:
    """Registered policies defined by refkv itself (the default contents of a suite)."""
    return [name for name in policy_registry.available()
            if policy_registry.policy_class(name).__module__.startswith("refkv.")]


# -- compression schedules (refkv.schedule) ------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleSetting:
    """One schedule golden: a label, the schedule, the prompt length, and the dtypes it is written in."""

    label: str
    schedule: object  # refkv.schedule.Schedule
    prompt_length: int
    dtypes: tuple = ("float64",)


def _schedule_settings(budget: int, prompt: int, fallback_block: int) -> tuple:
    return (
        # kvpress DecodingPress alone: the prompt is not compressed, then every 4 tokens down to N
        ScheduleSetting(f"sched-oneshot-K4-N{budget}", Schedule(None, None, 4, budget, new_tokens=12), prompt,
                        ("float64", "float32")),
        # blocks of 8 evicting to N, then at most N at every step (the engine's own rule)
        ScheduleSetting(f"sched-B8-K1-N{budget}", Schedule(8, budget, 1, budget, new_tokens=3), prompt),
        # PrefillDecodingPress: one-shot prefill to N, then every 16 tokens down to N
        ScheduleSetting(f"sched-oneshot{budget}-K16-N{budget}", Schedule(None, budget, 16, budget, new_tokens=48),
                        prompt),
        # CompressionRatioDecodingPress: every 4 tokens down to half the tokens seen
        ScheduleSetting("sched-oneshot-K4-ratio0.5", Schedule(None, None, 4, None, "ratio", 0.5, 12), prompt),
        # a policy that evicts before attention has no one-shot prefill with a budget: blocks instead
        ScheduleSetting(f"sched-B{fallback_block}-K16-N{budget}",
                        Schedule(fallback_block, budget, 16, budget, new_tokens=48), prompt),
    )


#: Schedule goldens per policy (tiny model), tried at N = 16 with a prompt of 24; a policy that
#: refuses N = 16 (SnapKV's default window of 32) gets N = 40 with a prompt of 48. The last
#: setting is written only when the third (one-shot prefill with a budget) is refused. At least
#: 3 decoding rounds each, K in {1, 4, 16}, one-shot and block prefill.
SCHEDULE_SETTINGS = (_schedule_settings(16, 24, 4), _schedule_settings(40, 48, 8))



# -- the authors' forms (form="authors"), each in its authors' regime --------------------------------------------
@dataclass(frozen=True)
class FormRegime:
    """Where a policy's authors' form (``form="authors"``) runs: the regime of the authors' code.

    An authors' form reproduces the authors' code *in that code's regime* and refuses the rest
    (SnapKV's compresses a one-shot prompt once, on one query head per KV head); its goldens keep
    to the regime, so a backend that ported the authors' code can produce every one of them.

    Attributes
    ----------
    options : dict
        The policy's options besides ``form="authors"`` (those the form needs, and the
        setting the authors' own candidates in ``tests/authors/`` ran, so those files are
        checked against these goldens).
    words : str
        The regime in words (the docs' table of the authors' goldens).
    model : str
        The model of the end-to-end and schedule goldens (:data:`refkv.oracle.models.MODELS`):
        ``"tiny-mha"`` where the authors' code selects per query head or cannot run GQA.
    mha : bool
        Vector cases with one query head per KV head (each recipe's ``n_kv_heads = n_heads``).
    modes : tuple of str
        The vector cases' modes (``"oneshot"``, ``"block"``).
    blocks : tuple of int or None
        Block-mode recipes of these block sizes only (None: all).
    engine : tuple
        Engine captures ``(dtype, layer, B)`` (``B=None``: one-shot) on ``model``.
    e2e : tuple of Setting
        End-to-end goldens, each in float64 and float32.
    schedules : tuple of ScheduleSetting
        Schedule goldens on ``model``.
    """

    options: dict
    words: str
    model: str
    mha: bool
    modes: tuple
    blocks: tuple | None
    engine: tuple
    e2e: tuple
    schedules: tuple


def _prefill_only(budget: int, prompt: int) -> ScheduleSetting:
    """The prompt compressed once, one-shot, to ``budget``; no decoding (SnapKV-style codes)."""
    return ScheduleSetting(f"sched-oneshot{budget}-prefill-only", Schedule(None, budget, 1, budget, new_tokens=0),
                           prompt, ("float64", "float32"))


def _decode_never_evicts(budget: int, prompt: int) -> ScheduleSetting:
    """One-shot prefill to ``budget``, then rounds every 16 tokens that keep every token (codes that
    never evict while decoding: a candidate must not either)."""
    return ScheduleSetting(f"sched-oneshot{budget}-K16-N{budget}", Schedule(None, budget, 16, budget, new_tokens=32),
                           prompt)


def _token_by_token(budget: int | None, prompt: int, new_tokens: int) -> ScheduleSetting:
    """One-shot prompt (to ``budget``, or uncompressed when None), then one eviction per token fed."""
    prefill = "oneshot" if budget is None else f"oneshot{budget}"
    return ScheduleSetting(f"sched-{prefill}-K1-N{16 if budget is None else budget}",
                           Schedule(None, budget, 1, 16 if budget is None else budget, new_tokens=new_tokens),
                           prompt, ("float64", "float32"))


_ONESHOT_ENGINE = (("float64", 3, None), ("float32", 1, None))
_SMALL_SNAPKV = {"window": 4, "kernel": 3}

#: Each policy with an authors' form (``form="authors"``) and its regime; the specs are
#: :func:`refkv.oracle.specs.authors_specs`, the suite ``tests/golden-authors``
#: (``refkv golden generate --out tests/golden-authors --authors-forms``). A policy whose
#: authors' code keeps what its paper form keeps (``knorm``, ``sink``: ``= paper form`` in
#: ``refkv policies --forms``) has no form of its own, and its suite goldens serve both.
AUTHORS_REGIMES: dict[str, FormRegime] = {
    "snapkv": FormRegime(
        {"pooling": "max"}, "one-shot prompt compressed once, per query head (tiny-mha); the authors' experiments' "
        "w = 32, k = 7, max pooling", "tiny-mha", True, ("oneshot",), None, _ONESHOT_ENGINE,
        (Setting(40, None, 64),), (_prefill_only(40, 64),)),
    "adakv": FormRegime(
        {"base_params": _SMALL_SNAPKV}, "one-shot prompt compressed once, per query head (tiny-mha); decoding "
        "keeps every token", "tiny-mha", True, ("oneshot",), None, _ONESHOT_ENGINE, (Setting(16, None, 40),),
        (_prefill_only(16, 40), _decode_never_evicts(16, 40))),
    "pyramidkv": FormRegime(
        {"base_params": _SMALL_SNAPKV}, "one-shot prompt compressed once, per query head (tiny-mha); decoding "
        "keeps every token", "tiny-mha", True, ("oneshot",), None, _ONESHOT_ENGINE,
        (Setting(16, None, 40),), (_prefill_only(16, 40), _decode_never_evicts(16, 40))),
    "hashevict": FormRegime(
        {"hash": "key"}, "one-shot prompt (cut to the first 4 and last N - 4 at the first step), then one "
        "eviction per generated token", "tiny", False, ("block",), (1,), (("float64", 3, 1), ("float32", 1, 1)),
        (Setting(16, 1, 28),), (_token_by_token(None, 24, 20),)),
    "h2o": FormRegime(
        {"recent": 2}, "real-drop cache without GQA (tiny-mha): the prompt, then one eviction per token",
        "tiny-mha", True, ("block", "oneshot"), None, ENGINE_CASES,
        (Setting(8, 4, 40), Setting(16, 1, 28), Setting(16, None, 40)), (_token_by_token(6, 16, 12),)),
    "tova": FormRegime(
        {}, "the prompt, then one eviction per token; GQA and not (the mean over all query heads)",
        "tiny", False, ("block", "oneshot"), None, ENGINE_CASES,
        (Setting(8, 4, 40), Setting(16, 1, 28), Setting(16, None, 40)), (_token_by_token(6, 16, 12),)),
}
