"""The data-parallel training loop, run on every rank. Depends on `torch.distributed`, not on Ray.

Read top to bottom: build (model, optimizer, schedule, state), restore, then one iteration per
optimizer step: faults -> forward/backward over `grad_accum_steps` micro-batches -> clip (global
grad norm) -> wait for the checkpoint snapshot -> optimizer step -> metrics -> commit/save.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_ft.checkpoint import Checkpointer, cleanup, list_step_dirs, step_of, step_path
from raytrain_ft.config import Config, TrainSection
from raytrain_ft.data.audit import DataAudit
from raytrain_ft.data.manifest import Manifest, load_manifest
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.errors import ConfigError
from raytrain_ft.faults import FaultInjector
from raytrain_ft.model import build_model, lm_loss
from raytrain_ft.session import Session
from raytrain_ft.tracking import RunLogger
from raytrain_ft.train_state import (
    KEY_DATA,
    KEY_META,
    KEY_MODEL,
    KEY_OPTIM,
    KEY_PROGRESS,
    KEY_SCHEDULER,
    ModelState,
    OptimizerState,
    Pickled,
    Progress,
    RNGState,
    RunMeta,
    TrainState,
    rng_key,
    seed_rngs,
)

log = logging.getLogger(__name__)


def lr_schedule(optimizer: torch.optim.Optimizer, t: TrainSection) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over `warmup_steps`, then cosine decay to `lr x min_lr_ratio` at `max_steps`."""
    warmup = max(1, min(t.warmup_steps, t.max_steps - 1))
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                optimizer, T_max=max(1, t.max_steps - warmup), eta_min=t.lr * t.min_lr_ratio
            ),
        ],
        milestones=[warmup],
    )


def fingerprint(cfg: Config, manifest: Manifest, num_params: int) -> dict:
    """What must match between a checkpoint and the run resuming it (model shape and data)."""
    return {
        "model.preset": cfg.model.preset,
        "num_params": num_params,
        "vocab_size": manifest.vocab_size,
        "seq_len": manifest.seq_len,
        "data.fingerprint": manifest.fingerprint,
        "train.global_batch_size": cfg.train.global_batch_size,
    }


def step_batches(session: Session, position: DataPosition, plan: BatchPlan, steps_per_epoch: int) -> Iterator[list]:
    """Endless iterator over steps; each item is this rank's `grad_accum_steps` micro-batches."""
    epoch, start = position.epoch, position.consumed
    end = steps_per_epoch * plan.global_batch_size
    while True:
        micro = session.micro_batches(epoch, start, end, plan)
        for _ in range((end - start) // plan.global_batch_size):
            yield [next(micro) for _ in range(plan.grad_accum_steps)]
        epoch, start = epoch + 1, 0


def train(cfg: Config, session: Session, tracking_uri: str, mlflow_run_id: str) -> None:
    """Train until `cfg.train.max_steps`, resuming from the session's latest checkpoint.

    Raises:
        ConfigError, DataError, CheckpointError: one-line user errors (see `raytrain_ft.errors`).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    manifest = load_manifest(cfg.data.path)
    if cfg.train.seq_len not in (0, manifest.seq_len):
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} but the dataset has seq_len {manifest.seq_len}")
    plan = BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    steps_per_epoch = manifest.num_samples // plan.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train.global_batch_size={plan.global_batch_size} exceeds the {manifest.num_samples} samples"
        )

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = build_model(cfg.model.preset, manifest.vocab_size, manifest.seq_len, cfg.model.dropout).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = lr_schedule(optimizer, cfg.train)
    progress, position = Progress(), DataPosition()
    num_params = sum(p.numel() for p in model.parameters())

    state = TrainState(rank)
    state.add(KEY_MODEL, ModelState(ddp))
    state.add(KEY_OPTIM, OptimizerState(ddp, optimizer))
    state.add(KEY_SCHEDULER, Pickled(scheduler))
    state.add(KEY_PROGRESS, Pickled(progress))
    state.add(KEY_DATA, Pickled(position))
    state.add(rng_key(rank), Pickled(RNGState()))
    state.add(KEY_META, RunMeta(fingerprint(cfg, manifest, num_params), mlflow_run_id))

    logger = RunLogger(tracking_uri, mlflow_run_id) if rank == 0 else None
    checkpointer = Checkpointer(session.run_root, lambda s, p: (audit.flush(), session.commit(s, p, {"step": s})))
    audit = DataAudit(session.run_root, checkpointer.control_group, cfg.data.audit)
    resumed_from, loaded = restore(checkpointer, state, session, logger)
    if rng_key(rank) not in loaded:  # fresh start, or a rank added by an elastic resize
        seed_rngs(cfg.train.seed + progress.step, rank)
    resumed_step = progress.step
    if logger:
        logger.metrics(progress.step, {"resumed_from_step": resumed_from or 0, "world_size": world_size})
        log.info(
            "rank 0: start at step %d (world size %d, grad_accum_steps %d)",
            progress.step,
            world_size,
            plan.grad_accum_steps,
        )

    faults = FaultInjector(cfg.faults, rank, session.run_root)
    batches = step_batches(session, position, plan, steps_per_epoch)
    preemption_saved = False
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    while progress.step < cfg.train.max_steps:
        step = progress.step + 1
        faults.before_step(step, settle=lambda: (checkpointer.wait(), session.flush()))
        t0 = time.perf_counter()
        micro_batches = next(batches)
        audit.record(step, torch.cat([mb["sample_id"] for mb in micro_batches]))
        loss = torch.zeros((), device=device)
        for i, mb in enumerate(micro_batches):
            tokens = mb["tokens"].to(device, non_blocking=True)
            sync = i == len(micro_batches) - 1  # all-reduce gradients only on the last micro-batch
            with ddp.no_sync() if not sync else contextlib.nullcontext(), autocast:
                micro_loss = lm_loss(ddp, tokens) / plan.grad_accum_steps
            micro_loss.backward()
            loss += micro_loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.train.grad_clip)
        checkpointer.wait_staged()  # the snapshot must be copied before the weights change
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        progress.step = step
        position.advance(plan.global_batch_size, steps_per_epoch)

        dist.all_reduce(loss)  # SUM (gloo has no AVG): the logged loss is the global mean
        loss_value = loss.item() / world_size
        step_time = time.perf_counter() - t0
        if logger:
            tokens_per_s = plan.global_batch_size * manifest.seq_len / step_time
            logger.metrics(
                step,
                {
                    "loss": loss_value,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": step_time,
                    "epoch": position.epoch,
                    "checkpoint_stall_s": checkpointer.last_stall_s,
                },
            )
            if step % 5 == 0 or step == resumed_step + 1:
                log.info(
                    "step %d/%d loss %.4f grad_norm %.3f %.0f tokens/s",
                    step,
                    cfg.train.max_steps,
                    loss_value,
                    grad_norm,
                    tokens_per_s,
                )
        checkpointer.last_stall_s = 0.0
        checkpointer.poll()
        if step % cfg.checkpoint.interval_steps == 0 or step == cfg.train.max_steps:
            checkpointer.save(step, state, slow_writer=faults.slow_save(step))
            faults.after_save_started(step)
        if not preemption_saved and session.preemption_pending():
            save_before_preemption(checkpointer, state, step, logger)
            preemption_saved = True
    checkpointer.wait()
    if not math.isfinite(loss_value):
        log.warning("final loss is not finite: %s", loss_value)


def save_before_preemption(checkpointer: Checkpointer, state: TrainState, step: int, logger: RunLogger | None) -> None:
    """Just-in-time checkpoint when a node is about to be preempted: save (unless this step's
    periodic save is in flight) and wait for the commit, so the restart loses nothing."""
    if checkpointer.pending is None or checkpointer.pending[0] != step:
        checkpointer.save(step, state)
    checkpointer.wait()
    if logger:
        logger.event("preemption_checkpoint", step=step)


def restore(
    checkpointer: Checkpointer, state: TrainState, session: Session, logger: RunLogger | None
) -> tuple[int | None, set[str]]:
    """Delete uncommitted saves, then load the committed checkpoint (or an older one if corrupt).

    Returns the step loaded (None on a fresh start) and the state keys the checkpoint held.
    """
    latest = session.latest_checkpoint()
    committed = step_of(latest) if latest else 0
    if dist.get_rank() == 0:
        removed = cleanup(session.run_root, committed)
        if removed:
            log.warning("deleted incomplete or uncommitted checkpoints at steps %s", removed)
    dist.barrier(group=checkpointer.control_group)
    if latest is None:
        return None, set()
    older = sorted((s for s, done in list_step_dirs(session.run_root).items() if done and s < committed), reverse=True)
    candidates = [latest] + [step_path(session.run_root, s) for s in older]

    def on_corrupt(path: str, reason: str) -> None:
        if logger:
            logger.event("corrupt_checkpoint", path=path, reason=reason)
            logger.tags({"last_corrupt_checkpoint": f"{path}: {reason}"})

    loaded, keys = checkpointer.restore(state, candidates, on_corrupt)
    return (step_of(loaded) if loaded else None), keys
