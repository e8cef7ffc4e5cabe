"""Prepare a pretraining dataset on Ray Data: `python jobs/prepare_data.py --input GLOB --output DIR`.

Defaults: the running Python's standard library sources, `data/stdlib`, seq_len 256, a trained
byte-level BPE of 8192 tokens, a validation split of 0.5 % of the documents (at least 16, at most
10,000; `raytrain_ft.data.prepare`). Connects to the cluster in `RAY_ADDRESS` (under `ray job submit`),
otherwise starts a local Ray instance. Ray Data's progress bars, then one line: documents, tokens,
samples, shards, tokens dropped, tokens/s. Exit status 2 with a one-line message on bad input.
"""

import argparse
import logging
import sys

from raytrain_ft.core.errors import UserError
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.prepare import prepare

# Ray Data logs a worker's exception with its stack before re-raising it; the one line below says it.
QUIET_LOGGERS = ("ray.data.exceptions", "ray.data._internal.execution.streaming_executor_state")


def main(argv: list[str] | None = None) -> int:
    d = PrepareSettings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default=None, help="file, folder, glob or fsspec URL (default: stdlib sources)")
    p.add_argument("--output", default="data/stdlib", help="dataset folder or fsspec URL")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: train a BPE)")
    p.add_argument("--eos-token", default=None, help="with --tokenizer: its EOS token (default: found in the file)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="vocabulary of a trained tokenizer")
    p.add_argument(
        "--tokenizer-sample-docs", type=int, default=d.tokenizer_sample_docs, help="documents a BPE trains on"
    )
    p.add_argument("--rows-per-row-group", type=int, default=d.rows_per_row_group, help="samples per row group")
    p.add_argument("--seed", type=int, default=d.seed, help="document shuffle and validation draw seed")
    p.add_argument(
        "--validation-fraction",
        type=float,
        default=d.validation_fraction,
        help="fraction of the documents held out as the validation split (0 with --validation-min-docs 0: none)",
    )
    p.add_argument(
        "--validation-min-docs", type=int, default=d.validation_min_docs, help="floor of the split, in documents"
    )
    p.add_argument(
        "--validation-max-docs", type=int, default=d.validation_max_docs, help="cap of the split, in documents"
    )
    args = p.parse_args(argv)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    settings = PrepareSettings(
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        rows_per_row_group=args.rows_per_row_group,
        tokenizer=args.tokenizer,
        eos_token=args.eos_token,
        tokenizer_sample_docs=args.tokenizer_sample_docs,
        seed=args.seed,
        validation_fraction=args.validation_fraction,
        validation_min_docs=args.validation_min_docs,
        validation_max_docs=args.validation_max_docs,
    )
    try:
        report = prepare(args.input, args.output, settings)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.line(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
