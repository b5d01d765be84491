"""Check kvpress's DecodingPress(KeyDiffPress) against refkv's decoding goldens, on SmolLM2.

Run from an empty folder with the interop extra installed (pip install 'refkv[interop]').
docs/oracle/decoding.rst includes this file from line 7; tests/oracle/test_oracle_decoding_page.py runs it.
"""

from kvpress import DecodingPress, KeyDiffPress
from refkv.cli import main
from refkv.interop.kvpress import write_candidates

MODEL = "smollm2"  # or tiny, llama3, qwen2, qwen3, a checkpoint directory
main(["golden", "generate", "--model", MODEL, "--policies", "keydiff", "--budget", "64", "--interval", "16",
      "--prompt-length", "128", "--out", "goldens"])  # every 16 new tokens down to 64, three rounds
write_candidates(DecodingPress(KeyDiffPress()), "goldens", "candidate", policy="keydiff")
assert main(["golden", "check", "candidate", "--against", "goldens", "--verbose"]) == 0
