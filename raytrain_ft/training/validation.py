"""Held-out validation: the mean next-token loss over a fixed set of validation sequences.

The set: the validation split of `data.path` (documents held out by `jobs/prepare_data.py`,
`raytrain_ft.data.prepare`), or every sample of the dataset at `validation.path` (prepared by the
same tool, with the training data's seq_len, vocabulary and EOS). Of it, the first
`num_batches x global_batch_size` samples in sample-id order (all of them at `num_batches: 0`): the
same N sequences, in the same order, at every validation of every attempt.

The split over W ranks, at any world size (the idea of `raytrain_ft.data.position.BatchPlan`):
rank r evaluates the contiguous sequences `[r*N // W, (r+1)*N // W)`, floor or ceil of N / W, in
`ceil(ceil(N / W) / m)` forward passes of at most `m = micro_batch_size` sequences. Every rank runs
the same number of passes because FSDP2 and HSDP all-gather each layer's parameters in every
forward; a rank whose share is shorter than its passes runs a dummy row that counts for nothing.
Each rank sums its per-sequence losses (a sequence's mean over its seq_len next-token predictions)
in float64, and one all_reduce of `[sum, count]` gives `val_loss = sum / N`: the mean over all N
sequences whatever W is (equal up to float rounding across world sizes and strategies, since the
passes group the sequences differently; bitwise equal for the same W and strategy).
`val_perplexity = exp(val_loss)`.

Under `failure.recovery: replica` it is not split across replicas: each replica validates the whole
set in its own group of one (W = 1). Wasteful (P times the compute) but correct, and it needs no
collective across replicas after a step commits (a peer failing there would leave the committed step
without its validation; a split would change with every quorum's size and re-read the set); the
replicas hold equal weights (the replica fingerprint checks it), so each computes the same
`val_loss`, and the step's recording replica records it.

Runs on every rank under the run's strategy, under `torch.no_grad()` and `model.eval()` (dropout
off, so no random numbers are drawn and training after a validation is the one without it), train
mode restored after. The rank's share is read once, at the first validation, with pyarrow (a
small split: no Ray Data), and kept in memory as int32: `ceil(N / W) x (seq_len + 1) x 4` bytes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from raytrain_ft.core.config import ValidationSection
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.data.manifest import Manifest, Shard, load_manifest
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.model.causal_lm import lm_loss
from raytrain_ft.model.parallel import Parallel


@dataclass(frozen=True)
class Validated:
    """One step's validation: `metrics` (`val_loss`: mean over the set's sequences, nats per token;
    `val_perplexity`) and its wall time in seconds; empty and 0 at a step without one."""

    metrics: dict[str, float]
    seconds: float


def validation_set(section: ValidationSection, data_path: str, manifest: Manifest) -> tuple[str, list[Shard], int]:
    """(folder, shards, number of samples) of the validation data (module doc).

    Raises:
        ConfigError: no validation split in `data_path` and no `validation.path`, or a
            `validation.path` dataset whose seq_len, vocabulary or EOS differ from the training data's.
        DataError: no dataset at `validation.path`.
    """
    if section.path:
        other = load_manifest(section.path)
        mine, theirs = ((m.seq_len, m.vocab_size, m.eos_token_id) for m in (manifest, other))
        if mine != theirs:
            raise ConfigError(
                f"validation.path {section.path} has (seq_len, vocab_size, eos) {theirs} but {data_path} has {mine}; "
                "prepare it with the training data's --tokenizer and --seq-len"
            )
        return section.path.rstrip("/"), other.shards, other.num_samples
    if manifest.validation is None:
        raise ConfigError(
            f"validation.interval_steps is set but {data_path} has no validation split; prepare it again with "
            "jobs/prepare_data.py (its default --validation-fraction holds documents out) or set validation.path"
        )
    v = manifest.validation
    return f"{data_path.rstrip('/')}/{v.folder}", v.shards, v.num_samples


def read_rows(folder: str, shards: list[Shard], lo: int, hi: int) -> np.ndarray:
    """Samples `[lo, hi)` (sample ids) of a dataset's shards: int32 (hi - lo, seq_len + 1)."""
    parts = []
    for s in shards:
        a, b = max(lo, s.first_sample_id), min(hi, s.first_sample_id + s.num_samples)
        if a < b:
            with fsspec.open(f"{folder}/{s.file}", "rb") as f:
                column = pq.read_table(f, columns=["tokens"]).column("tokens")
            parts.append(np.stack(column.slice(a - s.first_sample_id, b - a).to_numpy(zero_copy_only=False)))
    return np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros((0, 0), np.int32)


class Validation:
    """Every rank's validation at `validation.interval_steps` (module doc); off at 0.

    Raises (at construction, when on):
        ConfigError: see `validation_set`, or a validation set without samples.
    """

    def __init__(
        self,
        section: ValidationSection,
        data_path: str,
        manifest: Manifest,
        plan: BatchPlan,
        rank: int,
        par: Parallel,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        self.interval, self.par, self.group, self.device = section.interval_steps, par, group, device
        self.sequences: torch.Tensor | None = None
        if not self.interval:
            return
        self.folder, self.shards, available = validation_set(section, data_path, manifest)
        n = min(section.num_batches * plan.global_batch_size, available) if section.num_batches else available
        if n == 0:
            raise ConfigError(
                f"the validation set {self.folder} has no samples (its documents are shorter than seq_len + 1 "
                "tokens); prepare with a larger --validation-min-docs or set validation.path"
            )
        w = plan.world_size
        self.span = rank * n // w, (rank + 1) * n // w
        self.passes = math.ceil(math.ceil(n / w) / plan.micro_batch_size)  # the same on every rank
        self.dummy = torch.zeros((1, manifest.seq_len + 1), dtype=torch.int64)

    def maybe_run(self, step: int) -> Validated:
        """Validate after `step` when it is due (every rank together: collectives)."""
        if not self.interval or step % self.interval:
            return Validated({}, 0.0)
        return self.run()

    def run(self) -> Validated:
        started = time.perf_counter()
        if self.sequences is None:
            self.sequences = torch.from_numpy(read_rows(self.folder, self.shards, *self.span))
        module, totals = self.par.forward_module, torch.zeros(2, dtype=torch.float64)
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for part in torch.tensor_split(self.sequences, self.passes):
                    n = len(part)
                    tokens = (part if n else self.dummy).to(self.device, torch.int64)
                    with self.par.micro_batch(last=True):
                        loss = lm_loss(module, tokens).item()
                    totals[0] += loss * n
        finally:
            module.train(training)
        totals[1] = len(self.sequences)
        dist.all_reduce(totals, group=self.group)  # SUM over ranks
        val_loss = (totals[0] / totals[1]).item()
        metrics = {"val_loss": val_loss, "val_perplexity": math.exp(val_loss)}
        return Validated(metrics, time.perf_counter() - started)
