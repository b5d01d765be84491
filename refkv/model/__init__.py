"""The decoder: configuration, weights, forward pieces, loaders and tokenizers."""

from . import families
from .config import TINY, ModelConfig
from .decoder import Model
from .gguf import GGUFError, ModelNotFoundError, read_gguf
from .loading import builtin_model, load, load_with_tokenizer, model_path, peek_config
from .sample_text import english_prose
from .tokenizer import ByteTokenizer, Tokenizer
from .weights import LayerWeights, ModelWeights, random_weights

__all__ = [
           "TINY",
           "ByteTokenizer",
           "GGUFError",
           "LayerWeights",
           "Model",
           "ModelConfig",
           "ModelNotFoundError",
           "ModelWeights",
           "Tokenizer",
           "builtin_model",
           "english_prose",
           "families",
           "load",
           "load_with_tokenizer",
           "model_path",
           "peek_config",
           "random_weights",
           "read_gguf",
]
