"""``python -m shardkit.partition plan --shapes gpt2-small --world 8 --algo all``."""

from shardkit.partition._cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
