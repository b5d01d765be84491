"""Eviction policies: one module per family, all registered by name.

>>> from refkv import policies
>>> policies.get("sink", sink=4)
Sink(sink=4)
"""

# Importing a policy module registers its policies; one line per module.
from . import (  # noqa: F401
    adakv,
    caote,
    expected_attention,
    full,
    h2o,
    hashevict,
    keydiff,
    knorm,
    mat,
    pyramidkv,
    scissorhands,
    sink,
    snapkv,
    tova,
)
from .base import (
    SIGNALS,
    AttentionNeed,
    Policy,
    View,
    available,
    check_int,
    first_tokens,
    get,
    policy_class,
    policy_forms,
    recent_tokens,
    register,
    select,
    select_heads,
)
from .card import PolicyCard

__all__ = ["SIGNALS", "AttentionNeed", "Policy", "PolicyCard", "View", "available", "check_int", "first_tokens",
           "get", "policy_class", "policy_forms", "recent_tokens", "register", "select", "select_heads"]
