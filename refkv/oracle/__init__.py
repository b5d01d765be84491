"""refkv as an oracle: golden files other projects check their eviction kernels against.

* :mod:`refkv.oracle.schema` -- file kinds, versions, flags, arrays in JSON;
* :mod:`refkv.oracle.io` -- atomic, reproducible writing; reading without pickle;
* :mod:`refkv.oracle.vectors` -- score-function test vectors (JSON), read back;
  :mod:`refkv.oracle.encode` writes them;
* :mod:`refkv.oracle.endtoend` -- end-to-end goldens of tiny models (JSON + npz), read and
  written; :mod:`refkv.oracle.recorder` records them, running :mod:`refkv.oracle.models`;
* :mod:`refkv.oracle.compare` -- comparison, split by level: :mod:`~refkv.oracle.arrays`,
  :mod:`~refkv.oracle.tolerance`, :mod:`~refkv.oracle.declare`, :mod:`~refkv.oracle.retention`,
  :mod:`~refkv.oracle.cases`, :mod:`~refkv.oracle.walk`, :mod:`~refkv.oracle.checker`,
  :mod:`~refkv.oracle.report`, :mod:`~refkv.oracle.status`;
* :mod:`refkv.oracle.suite` -- the suite ``refkv golden generate`` writes;
* :mod:`refkv.oracle.cli` -- the ``refkv golden`` command.

The format is specified in ``docs/oracle/format.rst``; the assertions for other
projects' tests are in :mod:`refkv.testing`.
"""

from .compare import check_suite, compare_arrays, compare_retention
from .endtoend import EndToEnd, read_end_to_end
from .recorder import run_end_to_end
from .schema import SCHEMA_VERSION, SUPPORTED_VERSIONS
from .suite import generate_suite, read_suite
from .vectors import VectorCase, VectorFile, read_vectors

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_VERSIONS",
    "EndToEnd",
    "VectorCase",
    "VectorFile",
    "check_suite",
    "compare_arrays",
    "compare_retention",
    "generate_suite",
    "read_end_to_end",
    "read_suite",
    "read_vectors",
    "run_end_to_end",
]
