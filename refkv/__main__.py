"""``python -m refkv``: the same as the ``refkv`` command."""

from .cli import main

raise SystemExit(main())
