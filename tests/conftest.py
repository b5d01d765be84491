"""Shared test setup: hypothesis profiles and model fixtures.

Profiles: ``ci`` (derandomized, so a CI run is reproducible; chosen when the CI
environment variable is set) and ``dev`` (random, more examples). Select one
explicitly with ``--hypothesis-profile``.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

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
