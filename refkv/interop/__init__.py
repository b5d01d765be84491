"""Adapters that run other projects' KV-cache code against refkv's goldens (the ``interop`` extra).

Nothing in the core imports this package: it needs torch, transformers and the project it
adapts (``pip install 'refkv[interop]'``). :mod:`refkv.interop.kvpress` runs NVIDIA
kvpress's presses.
"""
