"""One-GPU check without Ray: NCCL process group, bf16 training steps, async checkpoint stall, load-back.

Single process, world size 1, `torch.distributed` with NCCL (`file://` rendezvous), on `cuda:0`:

1. `--strategy ddp` (default): the `125m` preset (vocab 8192, seq_len 512) built by
   `raytrain_ft.model.parallel.build` under DDP, AdamW, `--steps` timed training steps under bf16 autocast
   on random tokens (after 2 warm-up steps): steps/s, tokens/s and MFU (`raytrain_ft.model.causal_lm.flops_per_token`
   over the peak of the detected GPU, `raytrain_ft.model.hardware.GPUS`);
   `--strategy fsdp`: the `1b` preset under FSDP2 (`fully_shard`, one rank, bf16 `MixedPrecisionPolicy`,
   activation checkpointing unless `--no-activation-checkpointing`), the same measurements, plus the
   peak memory (`torch.cuda.max_memory_allocated`) against `raytrain_ft.model.memory.plan`'s estimate;
2. with `raytrain_ft.checkpoint.checkpointer.Checkpointer` (pinned-memory staging on CUDA), per round:
   stall of an async save = `save()` + one more step's forward/backward (the work the copy overlaps
   with, not counted) + `wait_staged()`; then the optimizer step; then a synchronous
   `torch.distributed.checkpoint.save` of the same state. Median over `--repeats` rounds, after one
   warm-up save that allocates the staging buffers (reported separately);
3. load-back: the model weights of the last async checkpoint
   (`load_model_state_dict(step_path(root, step))`) equal, tensor for tensor (`torch.equal`), the
   weights at the time of the save, although the optimizer step changed them right after.

Prints one JSON object and writes it to benchmarks/results/gpu_check.json. Exit status: 0 when the
load-back matches and the loss is finite, 1 otherwise (or after `--timeout-s`), 2 when there is no
CUDA device (safe to run anywhere). About a minute on one H100/H200.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import shutil
import statistics
import sys
import tempfile
import time

import torch

from report import default_out, report

VOCAB, SEQ_LEN = 8192, 512
PRESETS = {"ddp": "125m", "fsdp": "1b"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed training steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--repeats", type=int, default=3, help="measured checkpoint rounds")
    p.add_argument("--timeout-s", type=int, default=270, help="abort (traceback, status 1) after this long")
    p.add_argument("--strategy", choices=list(PRESETS), default="ddp", help="ddp (125m) or fsdp (1b)")
    p.add_argument("--no-activation-checkpointing", action="store_true", help="fsdp: keep every activation")
    p.add_argument("--out", default=None, help="default benchmarks/results/gpu_check[_fsdp].json")
    args = p.parse_args()
    args.out = args.out or default_out("gpu_check" if args.strategy == "ddp" else "gpu_check_fsdp")
    if args.steps < 1 or args.batch < 1 or args.repeats < 1:
        p.error("--steps, --batch and --repeats must be >= 1")

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing checked", file=sys.stderr)
        return 2
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from raytrain_ft.checkpoint.checkpointer import Checkpointer
    from raytrain_ft.checkpoint.reader import load_model_state_dict
    from raytrain_ft.checkpoint.train_state import ModelState, OptimizerState, TrainState
    from raytrain_ft.core.config_files import load_config
    from raytrain_ft.core.run_folder import step_path
    from raytrain_ft.model.causal_lm import flops_per_token, lm_loss
    from raytrain_ft.model.hardware import GPUS
    from raytrain_ft.model.memory import plan
    from raytrain_ft.model.parallel import build, local

    root = tempfile.mkdtemp(prefix="gpu-check-")
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{root}/store", rank=0, world_size=1)
    try:
        probe = torch.ones(4, device=device)
        dist.all_reduce(probe)
        nccl_ok = bool(torch.equal(probe.cpu(), torch.ones(4)))

        preset, checkpointing = PRESETS[args.strategy], args.strategy == "fsdp" and not args.no_activation_checkpointing
        cfg = load_config(
            None,
            [
                f"model.preset={preset}",
                "scaling.use_gpu=true",
                f"parallel.strategy={args.strategy}",
                f"parallel.activation_checkpointing={checkpointing}",
                "train.lr=1e-4",
            ],
        )
        par, optimizer = build(cfg, VOCAB, SEQ_LEN, device, resuming=False)
        model = par.model
        tokens = torch.randint(0, VOCAB, (args.batch, SEQ_LEN + 1), device=device)

        def forward_backward() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            with par.micro_batch(last=True):
                loss = lm_loss(par.forward_module, tokens)
            loss.backward()
            return loss

        def weights() -> dict[str, torch.Tensor]:
            return {k: local(v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

        def train_step() -> torch.Tensor:
            loss = forward_backward()
            optimizer.step()
            return loss

        losses = [train_step().item() for _ in range(2)]  # warm-up: kernels, allocator, AdamW state
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step()
        torch.cuda.synchronize()
        train_s = time.perf_counter() - t0
        peak_memory = torch.cuda.max_memory_allocated(device)
        losses.append(loss.item())
        planned = plan(preset, VOCAB, SEQ_LEN, args.batch, args.strategy, 1, 1, checkpointing, 80.0)

        state = TrainState(rank=0)
        state.add("model", ModelState(model))
        state.add("optim", OptimizerState(model, optimizer))
        ckpt = Checkpointer(root)

        def async_round(step: int) -> tuple[float, dict[str, torch.Tensor]]:
            """Stall of one async save between two steps; returns it and the weights at the save."""
            torch.cuda.synchronize()
            expected = weights()
            t0 = time.perf_counter()
            ckpt.save(step, state)
            returned = time.perf_counter() - t0
            forward_backward()  # the next step's work; the snapshot copy overlaps with it
            t1 = time.perf_counter()
            ckpt.wait_staged()
            stall = returned + time.perf_counter() - t1
            optimizer.step()  # mutates the weights right after staging, as the training loop does
            ckpt.wait()
            return stall, expected

        first_stall, _ = async_round(0)
        stalls, syncs = [], []
        for i in range(1, args.repeats + 1):
            stall, expected = async_round(i)
            stalls.append(stall)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.save(state.snapshot(), checkpoint_id=step_path(root, 1000 + i), process_group=ckpt.save_group)
            syncs.append(time.perf_counter() - t0)
            for done in (step_path(root, 1000 + i), step_path(root, i - 1)):  # ~1.2 GB each; keep step i
                shutil.rmtree(done, ignore_errors=True)

        saved_step = args.repeats
        loaded = load_model_state_dict(step_path(root, saved_step))
        mismatched = sorted(k for k in loaded.keys() | expected.keys() if not _same(loaded.get(k), expected.get(k)))
        weights_changed_after_save = any(not torch.equal(v, expected[k]) for k, v in weights().items())

        stall_s, sync_s = statistics.median(stalls), statistics.median(syncs)
        num_params = sum(p.numel() for p in model.parameters())
        name = torch.cuda.get_device_name(device)
        peak_tflops = next((tf for gpu, (_, tf) in GPUS.items() if gpu.split("-")[0] in name), None)
        tokens_per_s = args.steps * args.batch * SEQ_LEN / train_s
        result = {
            "device": name,
            "strategy": args.strategy,
            "activation_checkpointing": checkpointing,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": _nccl_version(),
            "nccl_all_reduce_ok": nccl_ok,
            "preset": preset,
            "num_params": num_params,
            "state_bytes": num_params * 4 * 3,  # fp32 weights + AdamW m + v
            "batch": args.batch,
            "seq_len": SEQ_LEN,
            "steps": args.steps,
            "steps_per_s": args.steps / train_s,
            "tokens_per_s": tokens_per_s,
            "mfu": flops_per_token(model, SEQ_LEN) * tokens_per_s / (peak_tflops * 1e12) if peak_tflops else None,
            "peak_memory_bytes": peak_memory,
            "planned_device_bytes": planned.device_total,
            "planned_by_part": {k: v for k, v in planned.as_dict().items() if k not in ("device_memory", "fits")},
            "peak_over_planned": peak_memory / planned.device_total,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "repeats": args.repeats,
            "first_save_stall_s": first_stall,
            "stall_s": stall_s,
            "sync_s": sync_s,
            "stall_over_sync": stall_s / sync_s,
            "load_back_step": saved_step,
            "load_back_equal": not mismatched,
            "load_back_mismatched": mismatched[:5],
            "weights_changed_after_save": weights_changed_after_save,
        }
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
        faulthandler.cancel_dump_traceback_later()

    report(result, args.out)
    ok = result["load_back_equal"] and nccl_ok and all(math.isfinite(x) for x in losses)
    return 0 if ok else 1


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and torch.equal(a, b)


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
