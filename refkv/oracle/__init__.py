"""refkv as an oracle: golden files other projects check their eviction kernels against.

* :mod:`refkv.oracle.schema` -- file kinds, versions, flags, arrays in JSON;
* :mod:`refkv.oracle.io` -- atomic, reproducible writing; reading without pickle;
* :mod:`refkv.oracle.vectors` -- score-function test vectors (JSON), read back;
  :mod:`refkv.oracle.encode` writes them;
* :mod:`refkv.oracle.endtoend` -- end-to-end goldens of tiny models (JSON + npz), read and
  written; :mod:`refkv.oracle.recorder` records them, running :mod:`refkv.oracle.models`;
* :mod:`refkv.oracle.candidates` -- the one gate every candidate array passes before it is
  compared (real, finite where judged, declared shapes, integral counts in range);
* comparison, by level: :mod:`~refkv.oracle.arrays`, :mod:`~refkv.oracle.tolerance`,
  :mod:`~refkv.oracle.declare`, :mod:`~refkv.oracle.retention`, :mod:`~refkv.oracle.cases`,
  :mod:`~refkv.oracle.walk`, :mod:`~refkv.oracle.rounds`, :mod:`~refkv.oracle.status`;
* :mod:`refkv.oracle.kinds` -- the kinds of golden file, declared once, each with its checker
  (:mod:`~refkv.oracle.vectorcheck`, :mod:`~refkv.oracle.e2echeck`,
  :mod:`~refkv.oracle.schedulecheck`); :mod:`refkv.oracle.checker` and
  :mod:`refkv.oracle.report` -- ``refkv golden check`` and its report;
* :mod:`refkv.oracle.recipes` -- what a suite holds; :mod:`refkv.oracle.goldens` builds one policy's goldens;
* :mod:`refkv.oracle.generate` -- ``refkv golden generate``, published through :mod:`refkv.oracle.staging`;
* :mod:`refkv.oracle.suiteindex` -- ``suite.json`` read back; :mod:`refkv.oracle.regenerate` -- what changed
  between two generations;
* :mod:`refkv.oracle.cli` -- the ``refkv golden`` command.

The format is specified in ``docs/oracle/format.rst``; the assertions for other
projects' tests are in :mod:`refkv.testing`.
"""

from .arrays import compare_arrays
from .checker import check_suite
from .endtoend import EndToEnd, read_end_to_end
from .generate import generate_suite
from .recorder import run_end_to_end
from .retention import compare_retention
from .schema import SCHEMA_VERSION, SUPPORTED_VERSIONS
from .suiteindex import read_suite
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
