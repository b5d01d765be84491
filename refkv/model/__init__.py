"""The decoder: configuration, weights, forward pieces and loaders."""

from .config import TINY, ModelConfig
from .decoder import Model
from .loading import builtin_model, load
from .weights import LayerWeights, ModelWeights, random_weights

__all__ = [
           "TINY",
           "LayerWeights",
           "Model",
           "ModelConfig",
           "ModelWeights",
           "builtin_model",
           "load",
           "random_weights",
]
