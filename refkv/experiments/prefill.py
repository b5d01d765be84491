"""A cell's prefill under its policy, or the reason it cannot run.

A grid lists every policy x budget x block; some combinations cannot run (a budget the
policy refuses, a block too large for a policy that evicts before attention). Such a cell
is recorded as skipped with the policy's reason (:func:`prefill_or_skip`), not as an error.
"""

from __future__ import annotations

from ..engine import Engine, blocks
from ..policies.spec import make_policy
from ..validation import check_context

__all__ = ["policy_error", "prefill_or_skip"]


def policy_error(spec: str, budget, block, config) -> str | None:
    """Why ``spec`` cannot run with this budget and block size, or None if it can.

    The policy answers: ``check`` for the budget, ``max_block`` for the block (a policy
    that evicts before attention must fit the block beside what it keeps).
    """
    try:
        policy = make_policy(spec)
        if budget is not None:
            policy.check(budget, config)
            limit = policy.max_block(budget, config)
            if limit is not None and (block is None or block > limit):
                whole = "the whole prompt" if block is None else str(block)
                return (f"{spec} evicts before attention, so a block must fit beside what it keeps: "
                        f"B must be <= {limit} with N={budget}, got B={whole}")
    except ValueError as err:
        return str(err)
    return None


def prefill_or_skip(params: dict, model, tokens, *, on_block=None):
    """Run a cell's policy (``params["policy"]``, ``"budget"``, ``"block"``) over ``tokens``.

    Returns ``(engine, logits, None)`` (the last token's logits), or ``(None, None, reason)``
    when the policy cannot run this cell: refused up front (:func:`policy_error`) or by the
    engine mid-run. ``on_block(start, logits)`` is called after each block with all its
    logits (B, vocab) when given (perplexity reads every token's).
    """
    spec, budget, block = params["policy"], params["budget"], params["block"]
    check_context(len(tokens), model.config.max_positions, f"the cell's prompt ({params.get('length', '?')} "
                  f"tokens asked)")  # a prompt beyond the context is an error of the grid, not a skip
    reason = policy_error(spec, budget, block, model.config)
    if reason is not None:
        return None, None, reason
    engine = Engine(model, make_policy(spec), budget)
    logits, start = None, 0
    try:
        for chunk in blocks(model.check_tokens(tokens), block):
            logits = engine.forward(chunk, all_logits=on_block is not None)
            if on_block is not None:
                on_block(start, logits)
                logits = logits[-1]
            start += len(chunk)
    except ValueError as err:  # a block / budget combination the policy refuses mid-run
        return None, None, str(err)
    return engine, logits, None
