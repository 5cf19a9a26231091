"""Decode speed and disk traffic of the disk tier against the host budget, on the CPU, for a small random Mixtral
written to disk.

For each host budget (a fraction of the experts' bytes, plus the non-expert weights, KV cache and staging the
budget must also hold) the model is loaded with ``OffloadConfig(policy=..., host_memory_gb=...)``, the
checkpoint's pages are dropped from the page cache (``posix_fadvise(DONTNEED)`` on each shard: works without
root; the global /proc/sys/vm/drop_caches needs privileges this container lacks, which the report says), and
``--new-tokens`` tokens are generated. Reported per budget: decode tok/s, disk bytes read per decoded token,
disk stall per token, and two yardsticks from the same run: the same policy with every expert in host memory
(the in-RAM peer), and the disk-bound limit ``disk GB/s / disk bytes per token`` from a cold read measured here.

    python -m benchmarks.disk.tier --out benchmarks/results/disk/bench_disk_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from moeflow import MoEModel, OffloadConfig
from moeflow.sim.disk import measure_disk

GiB = 2**30


def write_model(directory: Path, layers: int, experts: int, hidden: int, intermediate: int, seed: int = 0) -> Path:
    """A random Mixtral (fp16 safetensors) with weights scaled so routing is far from uniform."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=1024)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05 if "gate" not in name or "gate_up" in name else 0.5)
    model.half().save_pretrained(directory, max_shard_size="200MB")
    return directory


def drop_page_cache(directory: Path) -> bool:
    """Evict the checkpoint's shards from the page cache; False where the kernel refuses."""
    ok = True
    for f in directory.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def run(path: Path, policy: str, slots: int, host_gb: float | None, new_tokens: int, prompt_len: int) -> dict:
    model = MoEModel.from_pretrained(path, offload=OffloadConfig(policy=policy, gpu_expert_slots=slots,
                                                                 host_memory_gb=host_gb))
    try:
        ids = torch.randint(0, 1024, (1, prompt_len), generator=torch.Generator().manual_seed(0))
        model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # one-time costs out of the timing
        dropped = drop_page_cache(path)
        host = model.experts.host
        model.stats.reset()  # (zeroes the disk tier's counters too: model.stats.disk)
        before = host.stats.as_dict() if host.on_disk else None
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
        wall = time.perf_counter() - t0
        decode_s = model.stats.decode.time_s
        steps = max(1, model.stats.decode.steps)
        row = {"policy": policy, "slots": slots, "host_memory_gb": host_gb, "page_cache_dropped": dropped,
               "decode_tok_s": steps / decode_s if decode_s else None, "wall_s": wall,
               "tokens": out[0, prompt_len:].tolist(), "plan": model.memory_plan().as_dict()}
        if before is not None:
            after = host.stats.as_dict()
            disk = after["bytes_read"] - before["bytes_read"]
            row.update(host_experts=host.capacity, disk_bytes=disk, disk_bytes_per_token=disk / (steps + 1),
                       disk_stall_ms_per_token=(after["stall_s"] - before["stall_s"]) * 1e3 / (steps + 1),
                       prefetch_reads=after["prefetch_reads"] - before["prefetch_reads"])
        else:
            row.update(host_experts=model.memory_plan().total_experts, disk_bytes=0, disk_bytes_per_token=0.0,
                       disk_stall_ms_per_token=0.0)
        return row
    finally:
        model.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/moeflow-bench-disk-model")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--fractions", default="0.125,0.25,0.5", help="host expert cache as fractions of all experts")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = write_model(Path(args.dir), args.layers, args.experts, args.hidden, args.intermediate)
    peer = run(path, args.policy, args.slots, None, args.new_tokens, args.prompt_len)
    total, row_bytes = peer["plan"]["total_experts"], peer["plan"]["expert_bytes"]
    plan = peer["plan"]
    reserved = plan["non_expert"] + plan["kv_cache"]
    staging = 2 * (row_bytes // 2 + 4096)  # two readers, fp16 experts on disk (half the fp32 row) + alignment
    disk_gbps, disk_lat_us, how = measure_disk(row_bytes // 2, directory=str(path))
    rows = [peer]
    for frac in (float(f) for f in args.fractions.split(",")):
        budget = (reserved + staging + frac * total * row_bytes + row_bytes // 2) / GiB
        r = run(path, args.policy, args.slots, budget, args.new_tokens, args.prompt_len)
        r["same_tokens_as_in_ram"] = r["tokens"] == peer["tokens"]
        per_tok = r["disk_bytes_per_token"]
        r["disk_bound_tok_s"] = disk_gbps * 1e9 / per_tok if per_tok else None
        rows.append(r)
    for r in rows:
        print(f"host experts {r['host_experts']:4d}/{total}: decode {r['decode_tok_s']:.1f} tok/s, "
              f"{r['disk_bytes_per_token'] / 2**20:.2f} MiB from disk per token, disk stall "
              f"{r['disk_stall_ms_per_token']:.1f} ms/token"
              + (f", disk-bound limit {r['disk_bound_tok_s']:.1f} tok/s" if r.get("disk_bound_tok_s") else ""))
    report = {
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs (shared with other jobs: timings are noisy)",
        "torch_threads": args.threads, "model": {k: getattr(args, k) for k in ("layers", "experts", "hidden",
                                                                               "intermediate")},
        "policy": args.policy, "slots": args.slots, "disk_cold_read_gbps": disk_gbps, "disk_latency_us": disk_lat_us,
        "page_cache": f"dropped per shard before each timed run ({how}); /proc/sys/vm/drop_caches is not writable "
                      "here (container), so pages of other files and the global cache are not dropped",
        "rows": [{k: v for k, v in r.items() if k not in ("tokens", "plan")} for r in rows],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
