"""The sharded section of `make bench`: memory and step time of ddpkit's fsdp against ddp, hand-written FSDP2
(the same block policy) and the peers' FSDP, on a 50M-parameter MLP with Adam at 2 and 3 processes; and ddpkit's
hsdp against hand-written ``fully_shard`` on the same 2-D mesh (``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("replicate", "shard"))``, the same block policy, SUM reductions forced on gloo as ddpkit forces
them), at 4 processes with ``shard_size=2``: two replicas of a model sharded in halves. The same 50M MLP: a
4-process run takes about a minute on 2 cores (4-5 s a step, 4 processes sharing 2 cores). Each rank of hsdp
holds half a model, so its state is compared with ddp's full copy as ddp holds it at 2 processes (the run of the
same repetition): ddp's state does not depend on the process count, and no 4-process ddp run is spent on it.

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
    variants.update({f"{impl}_4p": run(impl, 4) for impl in ("hsdp", "raw-hsdp")})  # mesh 2 x 2: shard_size=2
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
    out["hsdp_state_mb_4p"], out["raw_hsdp_state_mb_4p"] = med("hsdp_4p", "state_mb"), med("raw-hsdp_4p", "state_mb")
    out["hsdp_step_ms_4p"], out["raw_hsdp_step_ms_4p"] = med("hsdp_4p", "median_ms"), med("raw-hsdp_4p", "median_ms")
    out.update(paired("hsdp_step_ratio_vs_raw_hsdp_4p", results["hsdp_4p"], results["raw-hsdp_4p"], "median_ms"))
    # ddp holds the whole model at any process count: its 2-process run of the same repetition (about 0.5)
    out.update(paired("hsdp_state_bytes_ratio_vs_ddp_4p", results["hsdp_4p"], results["ddp_2p"], "state_mb"))
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
