"""`chatd eval`: knowing a model is good before it serves, and keeping it so.

    chatd eval FILE --base-url URL --model M [--api-key K] [--judge-base-url URL --judge-model M]
                    [--min-score X] [--baseline FILE] [--json OUT]
    chatd eval add GOLDEN [--config C] [--limit N]

    golden.py   a golden set's JSON lines and how each item is scored
    scoring.py  exact, regex, schema, number, and the judge for rubrics
    run.py      the run against a served model, its score with a 95% interval, the gate
    add.py      users' thumbs-down replies and upheld output blocks as new golden items

This file declares the subcommand and imports nothing heavy; the rest loads when it runs.
"""

from __future__ import annotations

import argparse

from chatd.cli_args import positive_int


def add_parser(subparsers) -> None:
    """Register `chatd eval` on the CLI's subparsers."""
    evaluate = subparsers.add_parser(
        "eval", help="score a served model on a golden set and gate on it; `eval add` grows the set from reports",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="chatd eval FILE --base-url URL --model M [options]\n       chatd eval add GOLDEN [--config C]")
    evaluate.add_argument("target", metavar="FILE", help="the golden set (JSON lines), or `add`")
    evaluate.add_argument("golden", nargs="?", metavar="GOLDEN", help="with `add`: the golden set to append to")
    evaluate.add_argument("--base-url", help="the served model's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    evaluate.add_argument("--model", help="the model (or an alias's version, by its own name) to score")
    evaluate.add_argument("--api-key", help="the key to send (default: none)")
    evaluate.add_argument("--judge-base-url", help="an OpenAI-compatible endpoint that grades rubric items")
    evaluate.add_argument("--judge-model", help="the judge's model")
    evaluate.add_argument("--judge-api-key", help="the judge's key (default: --api-key)")
    evaluate.add_argument("--min-score", type=float, metavar="X", help="fail (exit 1) under this share of items passed")
    evaluate.add_argument("--baseline", metavar="FILE", help="a previous run's --json: fail (exit 1) under its score "
                          "by more than this run's 95%% interval")
    evaluate.add_argument("--json", metavar="OUT", help="write every item's reply and the score here")
    evaluate.add_argument("--concurrency", type=positive_int, default=4, help="requests at once (default 4)")
    evaluate.add_argument("--config", help="with `add`: a config.toml (its [store] says where the reports are)")
    evaluate.add_argument("--limit", type=positive_int, default=100, help="with `add`: read at most N reports of "
                          "each kind (default 100)")
    evaluate.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.target == "add":
        if not args.golden:
            raise ValueError("chatd eval add needs the golden set to append to: chatd eval add GOLDEN")
        from chatd.evals import add

        return add.main(args)
    if not args.base_url or not args.model:
        raise ValueError("chatd eval FILE needs --base-url and --model")
    if args.min_score is not None and not 0 <= args.min_score <= 1:
        raise ValueError(f"--min-score is a share of items passed, in [0, 1]; got {args.min_score}")
    from chatd.evals import run

    return run.main(args)
