"""Prepare a pretraining dataset: `python jobs/prepare_data.py --input GLOB --output DIR`.

Defaults: the running Python's standard library sources, `data/stdlib`, seq_len 256, vocab 8192.
Exit status 2 with a one-line message on bad input.
"""

import argparse
import sys

from raytrain_ft.data.prepare import PrepareSettings, prepare
from raytrain_ft.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default=None, help="file, folder, glob or fsspec URL (default: stdlib sources)")
    p.add_argument("--output", default="data/stdlib", help="dataset folder or fsspec URL")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--rows-per-row-group", type=int, default=512, help="samples per parquet row group (read unit)")
    args = p.parse_args(argv)
    settings = PrepareSettings(args.seq_len, args.vocab_size, args.rows_per_row_group)
    try:
        manifest, reused = prepare(args.input, args.output, settings)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verb = "reused" if reused else "wrote"
    shape = f"{manifest.num_samples} samples x {manifest.seq_len + 1} tokens"
    print(f"{verb} {args.output}: {shape}, vocab {manifest.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
