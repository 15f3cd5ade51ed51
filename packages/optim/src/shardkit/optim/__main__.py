"""``python -m shardkit.optim``: see :mod:`shardkit.optim._cli`."""

import sys

from shardkit.optim._cli import main

__all__: list[str] = []

sys.exit(main())
