"""What must match between a checkpoint and the run resuming it, and the one comparison of the two.

`fingerprint` is stored in every checkpoint (`train_state.RunMeta`); `check_fingerprint` compares a
checkpoint's with the current config's, for the driver's preflight (before any worker starts,
`raytrain_ft.training.preflight.check_checkpoint_compatible`) and for the restore on every rank
(`raytrain_ft.checkpoint.checkpointer.Checkpointer`), so both refuse the same resubmissions with the same line.
"""

from __future__ import annotations

from raytrain_ft.core.config import Config
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.core.run_folder import step_of
from raytrain_ft.core.schedule import extension_refusal
from raytrain_ft.data.manifest import Manifest


def fingerprint(cfg: Config, manifest: Manifest, num_params: int, model: dict) -> dict:
    """What must match between a checkpoint and the run resuming it: the network (`model`:
    `raytrain_ft.model.causal_lm.model_id`, a preset's name or an hf_config's type and digest) and its
    size, data, data order and LR schedule (a changed seed would re-permute a half-consumed epoch; a
    changed max_steps would stretch a cosine already half done). To train a wsd run further:
    `raytrain-ft extend` (raytrain_ft.core.schedule)."""
    return {
        **model,
        "num_params": num_params,
        "vocab_size": manifest.vocab_size,
        "seq_len": manifest.seq_len,
        "data.fingerprint": manifest.fingerprint,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.micro_batch_size": cfg.train.micro_batch_size,  # the lanes of the data order
        # the data order and the LR schedule: a resumed run must see the same ones
        "train.seed": cfg.train.seed,
        "train.max_steps": cfg.train.max_steps,
        "train.lr": cfg.train.lr,
        "train.warmup_steps": cfg.train.warmup_steps,
        "train.min_lr_ratio": cfg.train.min_lr_ratio,
        "train.lr_schedule": cfg.train.lr_schedule,
        "train.decay_steps": cfg.train.decay_steps,
    }


# recorded by the run's first start alone (its source), carried by every checkpoint after it, never
# compared: a resume does not read that source again (raytrain_ft.model.pretrained)
START_KEYS = ("model.init_from",)


def carry_start(saved: dict, current: dict) -> dict:
    """`current` with the `START_KEYS` entries of the `saved` fingerprint it lacks."""
    return {**{k: saved[k] for k in START_KEYS if k in saved}, **current}


def check_fingerprint(checkpoint: str, saved: dict, current: dict) -> int | None:
    """Compare the fingerprint `saved` in the checkpoint folder `checkpoint` with the `current` one.

    Returns:
        None when they match; the checkpoint's planned `train.max_steps` when only `train.max_steps`
        differs and the schedule allows training on to the current one (an extension: the driver
        also requires that `raytrain-ft extend` recorded it, `preflight.check_extended`).

    Raises:
        CheckpointError: one line: any other difference ("belongs to a different model or
            dataset", each key with both values), or an extension the schedule refuses
            (`raytrain_ft.core.schedule.extension_refusal`).
    """
    diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if set(diff) == {"train.max_steps"}:
        planned, target = diff["train.max_steps"]
        if reason := extension_refusal(saved, target, step_of(checkpoint)):
            raise CheckpointError(f"checkpoint {checkpoint} cannot continue to train.max_steps={target}: {reason}")
        return planned
    if diff:
        what = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise CheckpointError(
            f"checkpoint {checkpoint} belongs to a different model or dataset ({what}); "
            "use the original settings or a new run.name"
        )
    return None
