"""``python -m refkv.interop.kvpress GOLDEN_DIR``: print the docs blocks of docs/oracle/kvpress.rst."""

import sys

import torch

from .outcomes import docs_blocks

if __name__ == "__main__":
    torch.set_num_threads(1)
    print(docs_blocks(sys.argv[1] if len(sys.argv) > 1 else "tests/golden"))
