"""Run configuration: the schema, as dataclasses with their defaults and one comment per key.

The key names are a stable contract: tests, configs and docs/configuration.md's reference (generated
by `raytrain_ft.core.config_reference` from these comments) use them. Reading a config (a YAML file
plus dotted overrides) and checking its values: `raytrain_ft.core.config_files`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from raytrain_ft.core.fault_spec import FaultSpec

ALERT_POLICIES = ("warn", "restart")
INTERVAL_MODES = ("fixed", "auto")
STRATEGIES = ("auto", "ddp", "fsdp", "hsdp")
LR_SCHEDULES = ("cosine", "wsd")  # raytrain_ft.core.schedule
GPU_TYPES = ("A100-40GB", "A100-80GB", "H100", "H200")  # the keys of raytrain_ft.model.hardware.GPUS
RECOVERY_MODES = ("restart", "replica")  # raytrain_ft.resilience.replicas
STRAGGLER_ACTIONS = (
    "warn",
    "rebalance",
    "exclude",
)  # raytrain_ft.resilience.straggler, raytrain_ft.resilience.rebalance (docs/stragglers.md)


@dataclass
class RunSection:
    name: str = "demo"  # Ray Train run name; the run's folder is storage_path/name
    storage_path: str = "runs"  # local folder or fsspec URL holding checkpoints and run state


@dataclass
class DataSection:
    path: str = "data/stdlib"  # dataset folder written by jobs/prepare_data.py
    audit: bool = False  # record every step's sample ids per rank under <run folder>/audit


@dataclass
class ModelSection:
    preset: str = "tiny"  # tiny | small | 125m | 1b | 7b | 70b: a Llama shape (raytrain_ft.model.causal_lm.PRESETS)
    hf_config: str = ""  # a Hugging Face config.json (or its folder) of any causal LM; set, it replaces preset
    init_from: str = ""  # a Hugging Face model folder (config, safetensors, tokenizer): step 0 starts from its weights
    dropout: float = 0.0  # a preset's attention dropout probability; > 0 makes the RNG state matter


@dataclass
class TrainSection:
    max_steps: int = 100  # optimizer steps (skipped steps included) to run in total
    global_batch_size: int = 16  # sequences per step = micro_batch_size x grad_accum_steps x world_size
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    seq_len: int = 0  # 0 = take it from the dataset manifest; otherwise must equal it
    seed: int = 0  # seeds model init, data order and dropout
    lr: float = 3.0e-4  # peak learning rate of AdamW
    warmup_steps: int = 10  # linear warmup steps before the cosine decay (wsd: before the constant lr)
    min_lr_ratio: float = 0.1  # the schedule decays to lr x min_lr_ratio at max_steps
    lr_schedule: str = "cosine"  # cosine / wsd (warmup-stable-decay: extendable, see docs/extending-runs.md)
    decay_steps: int = 0  # wsd: the last decay_steps steps decay linearly to lr x min_lr_ratio; >= 1 under wsd
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm (clip_grad_norm_)


@dataclass
class ScalingSection:
    num_workers: Any = 2  # int, or [min, max] for elastic training
    use_gpu: bool = False  # one GPU per worker, NCCL backend
    cpus_per_worker: float = 0.5  # fractional so Ray Data read tasks still get CPU on small nodes
    gpu_type: str = "A100-40GB"  # A100-40GB / A100-80GB / H100 / H200: memory for the memory plan, peak for mfu
    gpus_per_node: int = 8  # GPUs of one node: hsdp's default shard size in the memory plan, host staging per node
    peak_tflops_per_device: float = 0.0  # dense bf16 peak of one GPU for mfu; 0 = the gpu_type's
    resize_check_interval_s: float = 60.0  # elastic: seconds between Ray Train's checks for nodes to grow back onto


@dataclass
class ParallelSection:
    strategy: str = "auto"  # ddp / fsdp / hsdp (raytrain_ft.model.parallel); auto = fsdp when scaling.use_gpu, else ddp
    shard_size: int = 0  # hsdp: ranks per shard group (must divide the world size); 0 = the GPUs of one node
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward (less memory)


@dataclass
class MemoryTierSection:
    """`checkpoint.memory`: the memory tier (`raytrain_ft.checkpoint.memory_tier`, docs/memory-tier.md).

    On when `interval_steps` > 0 or `interval: auto` (then `interval_steps` is only the first
    save's bound, as for durable checkpoints). Under replica recovery the step's saver writes the run's
    one copy, read when every replica restarts (docs/memory-tier.md#replica-recovery)."""

    interval_steps: int = 0  # memory checkpoint every N steps (each rank's state in its node's RAM); 0 = off
    interval: str = "fixed"  # fixed = every interval_steps; auto = Young/Daly from the memory tier's measured cost
    peer_copies: int = 1  # copies of each rank's memory checkpoint on other nodes (fewer if fewer nodes)
    dir: str = "/dev/shm/raytrain-ft"  # each node's folder for its copies (RAM-backed), one subfolder per node id
    max_bytes_per_node: int = 0  # the tier's bound on one node, checked by `check`; 0 = free bytes of dir there

    @property
    def enabled(self) -> bool:
        return self.interval_steps > 0 or self.interval == "auto"


@dataclass
class CheckpointSection:
    interval_steps: int = 50  # async checkpoint every N steps (and always at max_steps)
    interval: str = "fixed"  # fixed = every interval_steps; auto = Young/Daly from the measured cost and the MTBF
    num_to_keep: int = 3  # committed checkpoints Ray keeps; older ones are deleted
    memory: MemoryTierSection = field(default_factory=MemoryTierSection)


@dataclass
class FailureSection:
    """How the run survives failures.

    `recovery`:

    * `restart` (default): any failure stops every rank; Ray Train starts the whole group again and
      every rank reloads the last committed checkpoint from storage.
    * `replica` (`raytrain_ft.resilience.replicas`, needs the `[ft]` extra: torchft): every worker is a replica
      group holding the full model (DDP-style); when one dies, the others keep training and Ray
      Train replaces only the dead one, which heals from a live peer's memory, not from storage.
      Each step's global batch is dealt over the replicas that joined that step's quorum, and the
      data position advances only when the step commits. Fixed `scaling.num_workers` and the `ddp`
      strategy only (Ray Train 2.60 runs one worker per replica group); see docs/replica-recovery.md.
    """

    max_failures: int = 3  # worker-group restarts before the run fails (Ray FailureConfig)
    collective_timeout_s: int = 600  # process-group timeout: a stuck collective becomes an error
    mtbf_hours_per_gpu: float = 10000.0  # MTBF of one GPU (one worker on CPU), hours; for checkpoint.interval=auto
    group_start_timeout_s: float = 60.0  # a group start waits this long for its resources, then fails (counted)
    hang_timeout_s: float = 0.0  # no step this long: stacks recorded, attempt failed; 0 = max(10 x median step, 300 s)
    start_timeout_s: float = 1200.0  # no first step this long after Ray Train started a rank's process: the same
    liveness_timeout_s: float = 45.0  # a rank's process stopped (or its node silent) this long: dead, at any moment
    recovery: str = "restart"  # restart: a failure restarts every rank / replica: the healthy replicas keep training


@dataclass
class WaitsSection:
    """Bounds of the waits no other key bounds (docs/hangs-and-waits.md#every-wait-is-bounded lists every wait)."""

    commit_timeout_s: float = 60.0  # wait for Ray Train to register a commit; then the attempt fails (a restart)
    data_timeout_s: float = 120.0  # wait for one step's batch from the data pipeline; then the attempt fails
    quorum_timeout_s: float = 60.0  # replica: torchft quorum, its all-reduces, commit and heal; then the replica fails
    tracking_timeout_s: float = 30.0  # one MLflow request (the store unreachable: records are held and sent later)


@dataclass
class TrackingSection:
    uri: str = ""  # MLflow tracking URI; "" = $MLFLOW_TRACKING_URI, else sqlite:///$HOME/raytrain-ft/mlflow.db
    experiment: str = "raytrain-ft"  # MLflow experiment name


@dataclass
class SpikeSection:
    factor: float = 10.0  # skip when grad_norm > factor x median of the history
    window: int = 100  # accepted steps in the median's history
    warmup: int = 100  # history length before spikes are judged (non-finite norms always skip)
    max_consecutive_skips: int = 5  # this many skips in a row trigger a rollback
    skip_window_steps: int = 10  # global batches skipped after a rollback


@dataclass
class RankCheckSection:
    interval_steps: int = 10  # all_gather [loss, grad_norm] every N steps
    max_spread: float = 0.5  # relative spread above this is an alert


@dataclass
class FingerprintSection:
    interval_steps: int = 50  # compare replica weight checksums every N steps (and before each save)


@dataclass
class GuardsSection:
    spike: SpikeSection = field(default_factory=SpikeSection)
    rank_check: RankCheckSection = field(default_factory=RankCheckSection)
    fingerprint: FingerprintSection = field(default_factory=FingerprintSection)
    on_alert: str = "warn"  # warn | restart (raise a GuardError: Ray restarts from the last checkpoint)


@dataclass
class ValidationSection:
    interval_steps: int = 0  # held-out loss every N steps (val_loss, val_perplexity); 0 = off
    num_batches: int = 0  # global batches (global_batch_size sequences each) per validation; 0 = the whole split
    path: str = ""  # dataset folder (jobs/prepare_data.py) whose samples are the validation set; "" = data.path's split


@dataclass
class StragglerSection:
    """Straggler detection (`raytrain_ft.resilience.straggler`, always on) and what to do about a flagged rank.

    `action`: `warn` (the default: record a `straggler` event and keep training; the run's math,
    split and bits stay exactly those of a run without the detector, and a person decides);
    `rebalance` (also move sequences off the flagged rank in proportion to its speed from the next
    step, and back when it recovers, judged at the even split of a probe every `probe_every_steps`
    rebalanced steps: `raytrain_ft.resilience.rebalance`); `exclude` (a rank still
    flagged `exclude_after_steps` steps after its flag leaves at that step boundary: restart
    recovery restarts without its node, replica recovery replaces its replica;
    `raytrain_ft.resilience.straggler.Exclusion`, docs/stragglers.md).
    """

    action: str = "warn"  # warn: record the event; rebalance: move sequences off it; exclude: see exclude_after_steps
    threshold: float = 1.5  # slow at a step: its compute over what the others predict for its share exceeds this
    window: int = 10  # steps judged: a rank is flagged when slow in min_slow_steps of the last window steps
    min_slow_steps: int = 6  # of the last window steps; a flagged rank recovers when fast in as many
    exclude_after_steps: int = 30  # action exclude: a flagged rank not recovered this many steps after its flag leaves
    probe_every_steps: int = 100  # action rebalance: after this many rebalanced steps, window steps at the even split


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    failure: FailureSection = field(default_factory=FailureSection)
    waits: WaitsSection = field(default_factory=WaitsSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    guards: GuardsSection = field(default_factory=GuardsSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    straggler: StragglerSection = field(default_factory=StragglerSection)
    faults: list[FaultSpec] = field(
        default_factory=list
    )  # injected faults (raytrain_ft.resilience.faults), each once per run

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) number of workers; equal for a fixed-size run."""
        n = self.scaling.num_workers
        return (n, n) if isinstance(n, int) else (n[0], n[1])


def valid_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted config key, e.g. `train.max_steps`, `guards.spike.factor`."""
    keys = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            keys += valid_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys
