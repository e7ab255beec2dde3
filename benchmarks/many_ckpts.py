"""A save beside thousands of checkpoints (issue 45): one process saves in turn into a directory holding one
checkpoint and into one holding ``--count`` (copies of a real one, each its own step and commit), and prints the
per-pair ratio and difference of the save times. ``python benchmarks/many_ckpts.py --count 2000 --pairs 15``."""
import argparse
import json
import os
import shutil
import tempfile
import time

import torch

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--count", type=int, default=2000)
p.add_argument("--pairs", type=int, default=15)
args = p.parse_args()
ddpkit.init(seed=0)
model = ddpkit.prepare_model(torch.nn.Linear(64, 64))
root = tempfile.mkdtemp()
few, many = os.path.join(root, "few"), os.path.join(root, "many")
keep = args.count + 2 * args.pairs + 10  # nothing removed: the listing is what is measured
ddpkit.Checkpointer(few, keep=keep).save(1, model=model)
shutil.copytree(few, many)
source = os.path.join(many, "ckpt-0000000001")
record = json.load(open(os.path.join(source, "manifest.json")))
for i in range(2, args.count + 1):
    copy = os.path.join(many, f"ckpt-{i:010d}")
    shutil.copytree(source, copy)
    with open(os.path.join(copy, "manifest.json"), "w") as f:
        json.dump(dict(record, step=i, commit=i), f)
savers = {name: ddpkit.Checkpointer(path, keep=keep, resume=True) for name, path in (("few", few), ("many", many))}
for saver in savers.values():
    saver.restore(model=model)
ratios, extra, first = [], [], None
for i in range(args.pairs):
    took = {}
    for name in (("few", "many") if i % 2 else ("many", "few")):
        start = time.perf_counter()
        savers[name].save(args.count + 1 + i, model=model)
        took[name] = time.perf_counter() - start
    first = first if first is not None else took["many"]  # the process's first: every manifest read once
    ratios.append(took["many"] / took["few"])
    extra.append(took["many"] - took["few"])
shutil.rmtree(root)
print("BENCH " + json.dumps({"impl": "many_ckpts", "ratios": ratios[1:], "extra_s": extra[1:], "first_save_s": first,
                             "count": args.count}))
