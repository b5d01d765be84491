"""Policy specs: the one parser of policy names with parameters.

A policy is named in text two ways, and both are read here:

* a **spec**, ``name`` or ``name:param=value,param=value`` (experiments, records, tables),
  e.g. ``caote:base=h2o,fast=True``; the same with the parameters in parentheses,
  ``name(param=value,param=value)``, is the same spec (``adakv(base=keydiff,form=kvpress)``);
* the command line's ``--policy SPEC`` (either form), to which ``--param param=value``
  adds parameters (:func:`with_params`; the older ``--policy NAME --param ...`` form).

Values are Python literals read with :func:`ast.literal_eval` (numbers, strings, tuples,
lists, dicts, booleans, None), so nothing is executed; anything else is taken as a plain
string (``base=h2o``). Commas inside brackets or quotes do not split parameters, so a dict
value may hold several entries: ``caote:base=snapkv,base_params={'window': 8, 'kernel': 3}``.
:func:`canonical_spec` sorts the parameters so that one policy has one spec.
"""

from __future__ import annotations

import ast

from .base import Policy, get, policy_class

__all__ = ["canonical_spec", "make_policy", "parse_params", "parse_spec", "parse_spec_list", "parse_value",
           "with_params"]


def parse_value(raw: str):
    """A parameter value: a Python literal, or else the stripped text as a string."""
    text = raw.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _assignment(item: str, where: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"{where} must look like name=value, got {item!r}")
    return key, parse_value(raw)


def parse_params(items: list[str] | None) -> dict:
    """``["key=value", ...]`` (repeated ``--param``) -> ``{key: value}``."""
    params = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--param takes NAME=VALUE as one word, e.g. --param reserve=0.25; got {item!r}")
        params[key.strip()] = parse_value(raw)
    return params


def with_params(spec: str, items: list[str] | None) -> str:
    """The spec with ``--param`` items added to its parameters.

    ``with_params("keydiff", ["reserve=0.25"])`` is ``"keydiff:reserve=0.25"``, and so is
    ``with_params("keydiff(reserve=0.25)", [])`` up to spelling (without items the spec is
    returned as given). A parameter set both in the spec and by an item must agree.

    Raises
    ------
    ValueError
        As :func:`parse_spec` and :func:`parse_params`, or a parameter given twice with two values.
    """
    name, params = parse_spec(spec)
    extra = parse_params(items)
    if not extra:
        return spec
    for key, value in extra.items():
        if key in params and params[key] != value:
            raise ValueError(f"parameter {key!r} is given twice, {key}={_format_value(params[key])} in the spec "
                             f"{spec!r} and --param {key}={_format_value(value)}; give it once")
    merged = {**params, **extra}
    return name + ":" + ",".join(f"{k}={_format_value(v)}" for k, v in merged.items())


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets and quotes (so dict/tuple values may hold commas)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _name_and_rest(text: str) -> tuple[str, str]:
    """Split ``name:params`` or ``name(params)`` into the name and the parameter text."""
    paren, colon = text.find("("), text.find(":")
    if paren > 0 and (colon < 0 or paren < colon):
        if not text.endswith(")"):
            raise ValueError(f"policy spec {text!r}: a '(' after the name must close with ')' at the end, "
                             f"as in 'keydiff(reserve=0.25)'")
        return text[:paren].strip(), text[paren + 1:-1]
    name, _, rest = text.partition(":")
    return name.strip(), rest


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"name:a=1,b=x"`` (or ``"name(a=1,b=x)"``) -> ``("name", {"a": 1, "b": "x"})``.

    Raises
    ------
    ValueError
        If the name is not a registered policy or a parameter is not ``name=value``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy spec must be a non-empty string like 'sink' or 'caote:base=h2o', got {spec!r}")
    name, rest = _name_and_rest(spec.strip())
    policy_class(name)  # ValueError naming the available policies
    params = {}
    if rest.strip():
        for item in _split_top_level(rest):
            key, value = _assignment(item, f"policy spec {spec!r}: parameters")
            params[key] = value
    return name, params


def parse_spec_list(text: str) -> list[str]:
    """Comma-separated specs -> one spec per policy: ``"h2o,caote:base=snapkv,fast=True,tova"``
    -> ``["h2o", "caote:base=snapkv,fast=True", "tova"]``.

    An item that looks like ``name=value`` (an ``=`` before any ``:``) continues the
    previous spec's parameters; any other item starts a new spec. Each spec is checked with
    :func:`parse_spec` (ValueError naming an unknown policy or a malformed parameter).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"policy list must be a non-empty string like 'h2o,keydiff', got {text!r}")
    specs: list[str] = []
    for item in _split_top_level(text):
        item = item.strip()
        if not item:
            raise ValueError(f"policy list {text!r} has an empty item (two commas in a row, or a trailing comma)")
        head = item.split(":", 1)[0].split("(", 1)[0]
        if "=" in head:
            if not specs or ":" not in specs[-1] or specs[-1].endswith(")"):
                raise ValueError(f"policy list {text!r}: parameter {item!r} follows no 'name:' spec "
                                 f"(write name:{item})")
            specs[-1] += "," + item
        else:
            specs.append(item)
    for spec in specs:
        parse_spec(spec)
    return specs


def _format_value(value) -> str:
    if isinstance(value, str) and value.isidentifier() and value not in ("True", "False", "None"):
        return value
    return repr(value)


def canonical_spec(spec: str) -> str:
    """The spec with parameters sorted and values in a fixed form (one spec per policy)."""
    name, params = parse_spec(spec)
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={_format_value(params[k])}" for k in sorted(params))


def make_policy(spec: str) -> Policy:
    """Construct the policy a spec names."""
    name, params = parse_spec(spec)
    return get(name, **params)
