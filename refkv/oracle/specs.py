"""A golden's policy with its options: one canonical spec, a file-name tag, a report label.

Goldens are made for a policy **with options** (``refkv golden generate --policies
"adakv(base=keydiff,form=kvpress)"``), read with the one spec parser,
:mod:`refkv.policies.spec`. Three forms of the same policy are derived here, all from the
parameters the constructed policy reports (:meth:`~refkv.policies.Policy.params`), so a
spec written by hand and one read back from a golden's manifest agree:

* :func:`golden_spec`: ``"adakv:base=keydiff,form=kvpress"``, the policy's name and the
  parameters that differ from its defaults, sorted; a policy at its defaults is its bare
  name (what a suite lists and ``--policies`` selects);
* :func:`spec_tag`: ``"adakv+base-keydiff+form-kvpress"``, a folder name that tells goldens
  of the same policy with different options apart (``e2e/<tag>/``, ``vectors/<tag>.json``);
* :func:`spec_label`: ``"adakv(base=keydiff, form=kvpress)"``, what a report prints.

The authors' forms (``form="authors"``) have goldens of their own, each in its authors'
regime (:data:`refkv.oracle.recipes.AUTHORS_REGIMES`): :func:`authors_specs` lists their
specs, :func:`authors_regime` gives a spec's regime (the suite ``tests/golden-authors``).
"""

from __future__ import annotations

import hashlib
import re

from .. import policies as policy_registry
from ..policies.spec import parse_spec, parse_spec_list
from .recipes import AUTHORS_REGIMES, FormRegime
from .vectors import json_params

__all__ = ["authors_regime", "authors_specs", "golden_spec", "golden_specs", "manifest_spec", "spec_label",
           "spec_matches", "spec_name", "spec_tag"]

#: Characters a tag value may keep as they are (a folder name of :data:`refkv.oracle.kinds.SUITE_PATH`).
_PLAIN = re.compile(r"[A-Za-z0-9_.-]+")


def _text(value) -> str:
    """A JSON parameter value as spec text: an identifier-like string bare, anything else its repr."""
    if isinstance(value, str) and value.isidentifier() and value not in ("True", "False", "None"):
        return value
    if isinstance(value, dict):  # keys sorted: one text per dict
        return "{" + ", ".join(f"{k!r}: {value[k]!r}" for k in sorted(value, key=str)) + "}"
    return repr(value)


def _changed(name: str, params: dict) -> dict:
    """The parameters (JSON form) that differ from policy ``name``'s defaults."""
    defaults = json_params(policy_registry.get(name).params())
    return {k: v for k, v in sorted(params.items()) if k not in defaults or defaults[k] != v}


def manifest_spec(policy: dict) -> str:
    """The :func:`golden_spec` of a golden's ``policy`` entry (``{"name", "params"}``); a
    malformed entry gives its name or ``"?"``."""
    name = policy.get("name") if isinstance(policy, dict) else None
    if not isinstance(name, str):
        return "?"
    params = policy.get("params")
    try:
        changed = _changed(name, params) if isinstance(params, dict) else {}
    except ValueError:  # not a registered policy: its name is all there is to say
        return name
    return name + (":" + ",".join(f"{k}={_text(v)}" for k, v in changed.items()) if changed else "")


def golden_spec(text: str) -> str:
    """The canonical spec of one policy spec (``name``, ``name:a=1`` or ``name(a=1)``).

    Raises
    ------
    ValueError
        One line naming the spec: an unknown policy, a malformed or unknown parameter, a
        value the policy refuses.
    """
    name, params = parse_spec(text)
    try:
        policy = policy_registry.get(name, **params)
    except TypeError as err:  # an unknown keyword
        raise ValueError(f"policy spec {text!r}: {err}") from None
    except ValueError as err:
        raise ValueError(f"policy spec {text!r}: {err}") from None
    spec = manifest_spec({"name": name, "params": json_params(policy.params())})
    again_name, again = parse_spec(spec)  # the spec must give the same policy back
    if json_params(policy_registry.get(again_name, **again).params()) != json_params(policy.params()):
        raise ValueError(f"policy spec {text!r}: its parameters cannot be written back as a spec ({spec!r})")
    return spec


def golden_specs(policies, *, selecting: bool = False) -> list[str]:
    """Canonical specs of a list of policy specs (each item may itself be a comma-separated list,
    :func:`~refkv.policies.spec.parse_spec_list`); ValueError for none, a bad one, or one given twice.

    ``selecting``: the specs select goldens (:func:`spec_matches`). A spec that names options
    whose values are all the defaults (``snapkv(form=paper)``) then selects the goldens of the
    defaults alone -- written ``snapkv:`` -- where a bare name selects every golden of the policy.
    """
    if isinstance(policies, str):
        raise ValueError(f"policies must be a list of policy specs, got the string {policies!r}")
    items = list(policies)
    if all(isinstance(i, str) and not i.strip(" ,") for i in items):
        raise ValueError("policies must name at least one policy, got none (leave it out for every policy)")
    specs = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"policies must be policy specs, got {item!r}")
        if item.strip(" ,"):
            for text in parse_spec_list(item.strip(" ,")):
                spec = golden_spec(text)
                named = bool(parse_spec(text)[1])
                specs.append(spec + ":" if selecting and named and ":" not in spec else spec)
    twice = sorted({s for s in specs if specs.count(s) > 1})
    if twice:
        raise ValueError(f"policies lists {', '.join(map(repr, twice))} more than once")
    return specs


def spec_name(spec: str) -> str:
    """The policy name of a spec (what comes before ``:`` or ``(``)."""
    return re.split(r"[:(]", spec, maxsplit=1)[0].strip()


def spec_tag(spec: str) -> str:
    """A folder name for a canonical spec: the bare name, or ``name+key-value+...``.

    A value that is not plain text (quotes, brackets, spaces) is written as ``.`` and the
    first 10 hex digits of its text's SHA-256, so two specs never share a tag; a plain
    value never starts with ``.``.
    """
    name, params = parse_spec(spec)
    parts = [name]
    for key in sorted(params):
        text = _text(params[key])
        value = text if _PLAIN.fullmatch(text) and not text.startswith(".") else \
            "." + hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]
        parts.append(f"{key}-{value}")
    return "+".join(parts)


def spec_label(spec: str) -> str:
    """``"adakv(base=keydiff, form=kvpress)"`` for ``"adakv:base=keydiff,form=kvpress"``; a bare name as is."""
    if ":" not in spec:
        return spec
    name, params = parse_spec(spec)
    return f"{name}({', '.join(f'{k}={_text(v)}' for k, v in params.items())})"


def spec_matches(selector: str, spec: str) -> bool:
    """Whether ``--policies`` item ``selector`` (a canonical spec) selects a golden of ``spec``: the same
    spec, a bare name selecting every golden of that policy whatever its options, or ``name:``
    (:func:`golden_specs` with ``selecting``) the goldens of its default options alone."""
    if selector.endswith(":"):
        return spec == selector[:-1]
    return selector == spec or (":" not in selector and spec_name(spec) == selector)


def authors_specs() -> list[str]:
    """The canonical spec of every authors' form, in the regime's options
    (:data:`~refkv.oracle.recipes.AUTHORS_REGIMES`): ``"snapkv:form=authors,pooling=max"``, ...;
    in the registry's order."""
    order = policy_registry.available()
    return [golden_spec(_spec_text(name, {**AUTHORS_REGIMES[name].options, "form": "authors"}))
            for name in sorted(AUTHORS_REGIMES, key=order.index)]


def authors_regime(spec: str) -> FormRegime | None:
    """The regime of the authors' form ``spec`` (a canonical spec of :func:`authors_specs`); None
    for any other spec (its goldens are the suite's usual ones)."""
    regime = AUTHORS_REGIMES.get(spec_name(spec))
    return regime if regime is not None and spec in authors_specs() else None


def _spec_text(name: str, options: dict) -> str:
    """``name(key=value, ...)`` for the one spec parser (:func:`~refkv.policies.spec.parse_spec`)."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(options.items()))})"
