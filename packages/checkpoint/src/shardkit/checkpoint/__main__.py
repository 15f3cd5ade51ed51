"""``python -m shardkit.checkpoint``: see :mod:`shardkit.checkpoint._cli`."""

import sys

from shardkit.checkpoint._cli import main

__all__: list[str] = []

sys.exit(main())
