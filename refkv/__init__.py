"""refkv: a pure-NumPy reference implementation of KV-cache eviction policies.

The pieces, in the order data flows through them:

* :mod:`refkv.model` -- a Llama-family decoder (config, weights, forward pieces);
* :mod:`refkv.cache` -- the explicit per-layer KV cache with per-token policy state;
* :mod:`refkv.attention` -- causal grouped-query attention over cache + block;
* :mod:`refkv.engine` -- block prompt processing (KeyDiff Eq. 6) and greedy generation;
* :mod:`refkv.policies` -- the eviction policies and the one selection routine.
"""

__version__ = "0.1.0"

from . import policies
from .engine import Engine, generate, prefill
from .model import Model, ModelConfig, load

__all__ = ["Engine", "Model", "ModelConfig", "__version__", "generate", "load", "policies", "prefill"]
