"""Peak RSS of `raytrain-ft export` against its stated bound (`raytrain_ft.model.export.export_checkpoint`).

Writes a checkpoint of a model preset with random fp32 weights through DCP (one process, no process
group: the layout a one-rank run writes; a sharded run's only adds chunks per tensor, which the bound
covers), a dataset folder holding only what export reads (`manifest.json`, `tokenizer.json`), then
exports it in a fresh process. The peak is that process's high-water RSS during the export (`VmHWM`,
reset just before it through `/proc/self/clear_refs`) minus its RSS just before (torch, transformers,
safetensors and huggingface_hub already imported; importing them peaks at ~0.9 GB here, above the
export itself, so `ru_maxrss` would show nothing).

    PYTHONPATH=. python benchmarks/export_memory.py --preset 1b --vocab-size 32000 --max-shard-size 1GB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.train_state import KEY_META, KEY_MODEL, KEY_PROGRESS, Pickled, Progress, RunMeta
from raytrain_ft.data.manifest import MANIFEST, Manifest
from raytrain_ft.data.prepare import EOS, TOKENIZER_FILE, train_tokenizer
from raytrain_ft.model.causal_lm import build_model

DATA_FINGERPRINT = "synthetic"

# run in a fresh process: its peak RSS is the export's alone
MEASURE = """
import json, sys
import huggingface_hub, safetensors.torch, tokenizers, torch, transformers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from raytrain_ft.model.export import export_checkpoint
def status_bytes(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
checkpoint, out, data, shard = sys.argv[1:]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark (VmHWM) to the current RSS
before = status_bytes("VmRSS")
e = export_checkpoint(checkpoint, out, data, max_shard_size=int(shard) if shard.isdigit() else shard)
after = status_bytes("VmHWM")
print(json.dumps({"rss_before_bytes": before, "rss_peak_bytes": after, "bound_bytes": e.bound_bytes,
                  "total_bytes": e.total_bytes, "files": len(e.weight_files)}))
"""


def synthetic_dataset(folder: str, seq_len: int) -> str:
    """A dataset folder with a trained byte-level BPE (vocab 512) and a manifest, no shards."""
    os.makedirs(folder, exist_ok=True)
    tok = train_tokenizer(["def export(checkpoint, out_dir):\n    return json.dumps(weights)\n"] * 20, 512)
    with open(os.path.join(folder, TOKENIZER_FILE), "w") as f:
        f.write(tok.to_str())
    manifest = Manifest(0, seq_len, tok.get_vocab_size(), tok.token_to_id(EOS), TOKENIZER_FILE, DATA_FINGERPRINT, [])
    with open(os.path.join(folder, MANIFEST), "w") as f:
        f.write(manifest.to_json())
    return folder


def synthetic_checkpoint(
    folder: str, preset: str, vocab_size: int, seq_len: int, step: int = 1, mlflow_run_id: str = ""
) -> str:
    """`folder/step-<step>`: a DCP checkpoint of `preset` with random fp32 weights, its `RunMeta`
    (naming `mlflow_run_id`) and progress (holds the whole model in memory while writing)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in build_model(preset, vocab_size, seq_len).state_dict().items()}
    fingerprint = {"model.preset": preset, "vocab_size": vocab_size, "seq_len": seq_len}
    state = {
        KEY_MODEL: {k: torch.randn(s) for k, s in shapes.items()},
        KEY_META: RunMeta({**fingerprint, "data.fingerprint": DATA_FINGERPRINT}, mlflow_run_id),
        KEY_PROGRESS: Pickled(Progress(step)),
    }
    path = os.path.join(folder, f"step-{step}")
    dcp.save(state, storage_writer=ChecksummedWriter(path), no_dist=True)  # as the training run writes it
    return path


def measure(checkpoint: str, out_dir: str, data: str, max_shard_size: str) -> dict:
    """Export in a fresh process; its RSS before and after, the export's bound and sizes (bytes)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, checkpoint, out_dir, data, str(max_shard_size)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["peak_increase_bytes"] = result["rss_peak_bytes"] - result["rss_before_bytes"]
    return result


def main() -> None:
    from report import default_out, report, scratch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-shard-size", default="1GB")
    p.add_argument("--out", default=default_out("export_memory"))
    args = p.parse_args()
    tmp = scratch("export-bench-")
    data = synthetic_dataset(os.path.join(tmp, "data"), args.seq_len)
    checkpoint = synthetic_checkpoint(os.path.join(tmp, "run"), args.preset, args.vocab_size, args.seq_len)
    result = measure(checkpoint, os.path.join(tmp, "hf"), data, args.max_shard_size)
    gib = 2**30
    report(
        {
            "preset": args.preset,
            "vocab_size": args.vocab_size,
            "max_shard_size": args.max_shard_size,
            "model_gib": round(result["total_bytes"] / gib, 3),
            "bound_gib": round(result["bound_bytes"] / gib, 3),
            "peak_increase_gib": round(result["peak_increase_bytes"] / gib, 3),
            "rss_before_gib": round(result["rss_before_bytes"] / gib, 3),
            "weight_files": result["files"],
            "within_bound": result["peak_increase_bytes"] <= result["bound_bytes"],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
