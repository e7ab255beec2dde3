"""The rules of ``ddpkit check``: what each finds, why it matters, the fix, and its severity.

>>> sorted(RULES) == sorted(SEVERITY), SEVERITY["DDP008"], RULES["DDP011"][0]
(True, 'error', 'nn.DataParallel')
>>> finding("DDP011", 7).severity
'advice'
"""

from __future__ import annotations

import dataclasses

COLLECTIVES = {"all_reduce", "barrier", "broadcast", "all_gather", "reduce", "gather", "scatter",
               "all_gather_object", "broadcast_object_list", "reduce_scatter", "all_to_all", "monitored_barrier",
               # ddpkit's own collectives (ddpkit.runtime.control, ddpkit.runtime.collectives)
               "gather_object", "any_rank", "all_ranks", "main_process_first"}
RANK_WORDS = ("rank", "is_main", "main_process", "master", "gpu_id")  # gpu_id: the local rank in torch's tutorial
BATCHNORMS = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}

RULES = {
    "DDP001": ("DistributedSampler is never given set_epoch", "every epoch then reuses the same shuffle",
               "call sampler.set_epoch(epoch) at the start of each epoch, or ddpkit.data_loader (does it for you)"),
    "DDP002": ("DataLoader gets both a sampler and shuffle=True",
               "torch refuses the combination; the sampler already shuffles",
               "drop shuffle=True (DistributedSampler(shuffle=True) shuffles), or use ddpkit.data_loader"),
    "DDP003": ("evaluation data goes through a DistributedSampler",
               "it pads with repeated samples so every rank gets the same count: metrics count some samples twice",
               "ddpkit.data_loader(dataset, batch, train=False) shards without padding; reduce with ddpkit.reduce"),
    "DDP004": ("hard-coded cuda:0", "every rank then allocates on GPU 0 (out-of-memory, slow, wrong device)",
               "use torch.device('cuda', local_rank) after torch.cuda.set_device, or ddpkit's state.device"),
    "DDP005": ("BatchNorm under DDP without SyncBatchNorm",
               "each rank normalises with its own small batch: statistics differ from single-GPU training",
               "nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP, or ddpkit.prepare_model (converts)"),
    "DDP006": ("SummaryWriter created on every rank", "N writers produce N event files that confuse TensorBoard",
               "create it only when rank == 0, or use ddpkit.summary_writer (a no-op on other ranks)"),
    "DDP007": ("torch.save on every rank", "ranks race to write the same file; multi-node runs can corrupt it",
               "save only when rank == 0 (then barrier), or use ddpkit.Checkpointer (atomic, rank 0)"),
    "DDP008": ("collective (torch.distributed or ddpkit's) inside a rank-dependent branch",
               "ranks that skip the branch never join the collective: the job hangs",
               "call the collective on every rank, outside `if rank == ...`"),
    "DDP009": ("init_process_group(rank=local_rank)", "the local rank repeats on every node: wrong beyond one node",
               "pass the global RANK (or nothing: env:// reads it), or use ddpkit.init()"),
    "DDP010": ("torch.load without map_location",
               "tensors load onto the GPU they were saved from (usually GPU 0) on every rank",
               "torch.load(path, map_location=device), or ddpkit.Checkpointer.restore"),
    "DDP011": ("nn.DataParallel", "one process drives every GPU: slower than DDP, GPU 0 holds more memory",
               "use DDP (ddpkit launch --nproc-per-node gpu); ddpkit keeps DataParallel as mode 'dp' if you must"),
    "DDP012": ("argparse --local_rank only", "torchrun passes LOCAL_RANK in the environment and "
               "torch.distributed.launch now passes --local-rank (with a dash)",
               "read os.environ['LOCAL_RANK'], or accept both spellings, or let ddpkit.init() detect it"),
    "DDP013": ("NCCL process group without torch.cuda.set_device",
               "NCCL and CUDA calls default to GPU 0 on every rank", "call torch.cuda.set_device(local_rank) "
               "before init_process_group, or ddpkit.init()"),
    "DDP014": ("optimizer built before the model is sharded (prepare_model / fully_shard)",
               "sharding replaces the parameters the optimizer holds: under fsdp its steps train nothing",
               "build the optimizer after: model = ddpkit.prepare_model(model); opt = Adam(model.parameters())"),
    "DDP015": ("state_dict() on rank 0 only, in a sharded (FSDP) script",
               "each rank holds a shard: gathering the full state dict is collective, so rank 0 waits forever "
               "(ddpkit), or saves only its own shard (raw FSDP2)", "call state_dict() on every rank and save on "
               "rank 0, or use ddpkit.Checkpointer (each rank writes its shard)"),
    "DDP017": ("print of a loss or .item() on every rank", "N copies of the line, each with only this rank's value "
               "(not the global one)", "ddpkit.print(ddpkit.reduce(loss.item(), 'mean')): reduced, printed once"),
    "DDP018": ("a local count divided by the whole dataset's size, never reduced",
               "each rank counted only its shard: the metric is about 1/N of the truth",
               "reduce the count first (dist.all_reduce, or ddpkit.reduce(correct)) and divide the global sum"),
    "DDP019": ("evaluation DistributedSampler with drop_last=True, and the remainder evaluated nowhere",
               "the last len % world_size samples are silently skipped: the metric misses them",
               "evaluate the rest through a Subset of the same dataset on one rank, or use ddpkit.data_loader(ds, "
               "bs, train=False) (every sample once)"),
    "DDP016": ("an IterableDataset that never splits by rank, through a plain DataLoader in a DDP script",
               "every rank (and every loader worker) reads the whole stream: each sample is trained on N times",
               "ddpkit.data_loader(stream, batch_size) splits it across ranks and workers; or skip samples by "
               "rank and get_worker_info() in __iter__"),
    "DDP020": ("zero_grad() inside the loop over step.micro_batches()",
               "each micro-batch erases the gradients of the ones before it: the step trains on its last micro-batch",
               "call optimizer.zero_grad() once per step, after optimizer.step(), outside the micro-batch loop"),
}
SHARDING = ("fully_shard", "FullyShardedDataParallel", "fsdp", "hsdp")  # a script that says it shards
OPTIMIZERS = {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam", "RAdam", "LBFGS",
              "SparseAdam", "Rprop", "ASGD", "Adafactor", "Muon"}

# error: a hang, a crash or a wrong result; warning: wrong beyond one node, or wasteful; advice: a better way
SEVERITY = {"DDP001": "warning", "DDP002": "error", "DDP003": "error", "DDP004": "error", "DDP005": "warning",
            "DDP006": "warning", "DDP007": "warning", "DDP008": "error", "DDP009": "warning", "DDP010": "warning",
            "DDP011": "advice", "DDP012": "error", "DDP013": "error", "DDP014": "error", "DDP015": "error",
            "DDP016": "error", "DDP017": "warning", "DDP018": "error",
            "DDP019": "error", "DDP020": "error"}


@dataclasses.dataclass(frozen=True)
class Finding:
    line: int
    rule: str
    severity: str  # error: hang, crash or wrong result; warning: wrong beyond one node, or wasteful; advice
    message: str
    why: str
    fix: str


def finding(rule: str, line: int) -> Finding:
    message, why, fix = RULES[rule]
    return Finding(line, rule, SEVERITY[rule], message, why, fix)
