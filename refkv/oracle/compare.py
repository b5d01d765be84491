"""Comparison of a candidate's outputs with refkv's (re-exports; the code lives by level).

* :mod:`refkv.oracle.arrays` -- shape, dtype, values of two arrays;
* :mod:`refkv.oracle.tolerance` -- tolerances from the candidate's dtype and each value's scale;
* :mod:`refkv.oracle.declare` -- declared differences;
* :mod:`refkv.oracle.retention` -- kept sets, ties and the rule that accepted each;
* :mod:`refkv.oracle.cases` -- one vector case (:func:`compare_case`);
* :mod:`refkv.oracle.walk` -- end-to-end goldens, per block or final cache only;
* :mod:`refkv.oracle.checker` and :mod:`refkv.oracle.report` -- files, suites, report text;
* :mod:`refkv.oracle.status` -- the one vocabulary of verdicts.
"""

from .arrays import Mismatch, as_array, compare_arrays
from .cases import CaseResult, compare_case
from .checker import check_end_to_end_file, check_suite, check_vector_file
from .declare import Declarations
from .report import FileReport, SuiteReport
from .retention import RetentionResult, Swap, compare_kept, compare_retention
from .status import Status
from .walk import EndToEndResult, compare_end_to_end

__all__ = [
    "CaseResult",
    "Declarations",
    "EndToEndResult",
    "FileReport",
    "Mismatch",
    "RetentionResult",
    "Status",
    "SuiteReport",
    "Swap",
    "as_array",
    "check_end_to_end_file",
    "check_suite",
    "check_vector_file",
    "compare_arrays",
    "compare_case",
    "compare_end_to_end",
    "compare_kept",
    "compare_retention",
]
