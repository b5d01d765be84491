"""Eviction policies: one module per family, all registered by name.

>>> from refkv import policies
>>> policies.get("sink", sink=4)
Sink(sink=4)
"""

from . import full, sink  # noqa: F401  (importing registers the policies)
from .base import (
    SIGNALS,
    Policy,
    View,
    available,
    check_int,
    first_tokens,
    get,
    policy_class,
    recent_tokens,
    register,
    select,
)

__all__ = ["SIGNALS", "Policy", "View", "available", "check_int", "first_tokens", "get",
           "policy_class", "recent_tokens", "register", "select"]
