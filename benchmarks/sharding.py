"""The sharded section of `make bench`: memory and step time of ddpkit's fsdp against ddp, hand-written FSDP2
(the same block policy) and the peers' FSDP, on a 50M-parameter MLP with Adam at 2 and 3 processes.

Memory is counted two ways per rank (max over ranks): the training state held (parameters + gradients +
optimizer state, local shards; tensor accounting) and peak RSS. On CPU, glibc keeps freed all-gather
buffers in its heap, so peak RSS is also measured with MALLOC_MMAP_THRESHOLD_=131072 (freed buffers go
back to the OS), for both modes.
"""
import statistics
import sys

WORKER = "shard_worker.py"
MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def measure(reps, torchrun, interleave, paired, peers_env=None):
    """Returns flat keys. The harness is handed in, so this section never imports bench.py (which imports it):
    torchrun(impl, *extra, nproc=, env=, worker=) runs benchmarks/shard_worker.py; interleave(reps, variants) is
    bench.py's rotation of the variants (the same as every other figure); paired(key, a_runs, b_runs, field) its
    median of per-repetition ratios with its interval.

    Example (bench.py's call)::

        sharding.measure(3, torchrun, interleave, paired, peers_env=None)
    """
    def run(impl, nproc, env=None):
        return lambda: torchrun(impl, nproc=nproc, env=env, worker=WORKER)

    variants = {f"{impl}_{n}p": run(impl, n) for n in (2, 3) for impl in ("fsdp", "ddp", "raw-fsdp2")}
    variants.update({f"{impl}_2p_mmap": run(impl, 2, MMAP) for impl in ("fsdp", "ddp")})
    results = interleave(reps, variants)

    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    out = {"sharded_params_m": results["fsdp_2p"][0]["params_m"]}
    for n in (2, 3):
        out[f"fsdp_state_mb_{n}p"] = med(f"fsdp_{n}p", "state_mb")
        out[f"ddp_state_mb_{n}p"] = med(f"ddp_{n}p", "state_mb")
        out[f"raw_fsdp2_state_mb_{n}p"] = med(f"raw-fsdp2_{n}p", "state_mb")
        out.update(paired(f"fsdp_state_bytes_ratio_vs_ddp_{n}p", results[f"fsdp_{n}p"], results[f"ddp_{n}p"],
                          "state_mb"))
        out.update(paired(f"fsdp_rss_ratio_vs_ddp_{n}p", results[f"fsdp_{n}p"], results[f"ddp_{n}p"], "rss_mb"))
        out[f"fsdp_step_ms_{n}p"], out[f"raw_fsdp2_step_ms_{n}p"] = med(f"fsdp_{n}p", "median_ms"), \
            med(f"raw-fsdp2_{n}p", "median_ms")
        out[f"ddp_step_ms_{n}p"] = med(f"ddp_{n}p", "median_ms")
        # paired: each ddpkit run against the raw run of the same repetition
        out.update(paired(f"fsdp_step_ratio_vs_raw_fsdp2_{n}p", results[f"fsdp_{n}p"], results[f"raw-fsdp2_{n}p"],
                          "median_ms"))
    out.update({k.replace("_2p", ""): v for k, v in out.items() if k.startswith("fsdp_step_ratio_vs_raw_fsdp2_2p")})
    out["fsdp_rss_mb_2p_mmap"], out["ddp_rss_mb_2p_mmap"] = med("fsdp_2p_mmap", "rss_mb"), med("ddp_2p_mmap", "rss_mb")
    out.update(paired("fsdp_rss_ratio_vs_ddp_2p_mmap", results["fsdp_2p_mmap"], results["ddp_2p_mmap"], "rss_mb"))
    out.update(paired("fsdp_step_ratio_mmap_vs_default_2p", results["fsdp_2p_mmap"], results["fsdp_2p"],
                      "median_ms"))
    for peer in ("accelerate", "fabric"):
        if peers_env is None:
            out[f"{peer}_fsdp_cpu"] = "not installed"
            continue
        got = torchrun(peer, nproc=2, env=peers_env, worker=WORKER)
        out[f"{peer}_fsdp_cpu"] = got.get("error") or \
            f"ran: state {got['state_mb']:.0f} MB, step {got['median_ms']:.0f} ms"
    print(f"bench: sharded section done ({reps} repetitions)", file=sys.stderr)
    return out
