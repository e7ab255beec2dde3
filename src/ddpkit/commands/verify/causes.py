"""What ``ddpkit verify`` can say about a FAIL, and what it refuses to compare, from what the runs measured.

Each run writes its facts and its step-1 gradients (:mod:`ddpkit.commands.verify.recorder`). A FAIL then names its
likely cause instead of one line for every difference (a VAE's sampling noise and a summed loss used to read alike):

- the step-1 gradients are equal up to one constant factor: a loss reduction (``reduction='sum'``) or a
  scale that depends on the batch size;
- torch's random generator was drawn from during a step (from its first training forward to its optimizer
  step: a DataLoader's seed draw at ``iter()`` is none): random draws outside dropout (sampling noise)
  differ between one process and N by design;
- a training loader without ``count=`` hands out labels of -100: a token-mean loss weighted by samples;
- a training forward ran under autocast in a low-precision dtype: its rounding depends on the batch;
- otherwise: rank-dependent code (a branch on the rank, per-rank statistics, an update outside backward).

Example::

    >>> g = {"w": torch.tensor([1.0, -2.0])}
    >>> likely_cause(g, {"w": g["w"] / 2}, {"passed": False, "first_diverging": "w"}, random_draws=False)[:72]
    'the step-1 gradients differ by a factor of 2 (1 process / 2 processes) f'
"""

from __future__ import annotations

import os
import re

import torch

from ddpkit.data.global_batch import largest_micro_batch

NEEDS_LOADER = ("no ddpkit.data_loader training loader handed out a batch (the script feeds batches of its own), "
                "so the one-process run cannot take the N processes' global batch; build the training loader with "
                "ddpkit.data_loader(dataset, batch_size=...) (tensors of its own: wrap them in a "
                "TensorDataset; the loader shards it per rank)")
NO_BATCHES = ("a ddpkit.data_loader was built but handed out no batch: the training loop never ran (the script "
              "resumed from a checkpoint it found at start, past its last epoch, or had no epoch to train); remove "
              "what an earlier run left there (its checkpoints) or give it an epoch, then verify again")
NEEDS_MODEL = ("the script prepared no model, so there are no weights to compare; wrap the model with "
               "model = ddpkit.prepare_model(model) before training")
NO_WEIGHTS = ("the {run} prepared a model but ended without writing its weights (os._exit, or killed before "
              "ddpkit's shutdown hooks ran); let the script end by returning, or call ddpkit.shutdown() before "
              "os._exit")


def refusal(facts: dict | None, run: str = "one-process run") -> str | None:
    """Why the one-process run's ``facts`` cannot be compared with an N-process run, or None.

    >>> refusal({"models": 1, "batches": 0}) == NEEDS_LOADER, refusal({"models": 1, "batches": 3})
    (True, None)
    >>> refusal({"models": 1, "batches": 0, "loaders": 1}) == NO_BATCHES
    True
    >>> refusal({"models": 1, "batches": 3, "finished": False})[:49]
    'the one-process run prepared a model but ended wi'
    """
    if not facts or not facts.get("models"):
        return NEEDS_MODEL
    if facts.get("finished") is False:
        return NO_WEIGHTS.format(run=run)
    if not facts.get("batches"):  # (a loader made and never drawn from: the loop did not run)
        return NO_BATCHES if facts.get("loaders") else NEEDS_LOADER
    return None


def scale_factor(one: dict[str, torch.Tensor], many: dict[str, torch.Tensor]) -> float | None:
    """``c`` when ``one == c * many`` for every tensor (relative residual under 1e-3) and ``c`` is not 1.

    >>> scale_factor({"w": torch.tensor([2.0, 4.0])}, {"w": torch.tensor([1.0, 2.0])})
    2.0
    >>> scale_factor({"w": torch.tensor([2.0, 4.0])}, {"w": torch.tensor([2.0, 1.0])}) is None
    True
    """
    a = torch.cat([t.double().flatten() for t in one.values()])
    b = torch.cat([many[k].double().flatten() for k in one])
    if not (a.isfinite().all() and b.isfinite().all()) or float(b.dot(b)) == 0.0:
        return None
    c = float(a.dot(b) / b.dot(b))
    residual = float((a - c * b).norm() / a.norm().clamp_min(1e-30))
    return c if residual < 1e-3 and abs(c - 1.0) > 1e-3 else None


def gradient_gap(one: dict[str, torch.Tensor], many: dict[str, torch.Tensor]) -> float | None:
    """How far apart the runs' step-1 gradients are, over the whole model: ``|one - many| / |one|`` (L2 over every
    tensor both hold; None when they hold different tensors or none). Said, not decided on: float rounding parted
    them by 1e-6 to 7.5e-4 in correct BatchNorm networks and by 0.13 in one over inputs near 3000, more than
    per-rank statistics (a defect) in a ResNet (0.064); the float64 re-run decides (:mod:`.rounding`).

    >>> gradient_gap({"w": torch.tensor([3.0, 4.0], dtype=torch.float64)},
    ...              {"w": torch.tensor([3.0, 4.0005], dtype=torch.float64)})
    0.0001
    """
    if not one or set(one) != set(many):
        return None
    gap = sum(float((one[k].double() - many[k].double()).norm()) ** 2 for k in one)
    size = sum(float(one[k].double().norm()) ** 2 for k in one)
    return round((gap / size) ** 0.5, 12) if size > 0 else None


def _model_of(name: str, one: dict[str, torch.Tensor], many: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The gradients of the model ``name`` belongs to (its ``model<i>.`` prefix, when the runs prepared two
    models or more): a GAN's generator with a summed loss scales by N while its discriminator agrees.

    >>> sorted(_model_of("model1.w", {"model0.w": 1, "model1.w": 2, "model1.b": 3}, {})[0])
    ['model1.b', 'model1.w']
    """
    head = name.split(".", 1)[0]
    if not (head.startswith("model") and head[5:].isdigit()):
        return one, many
    keys = [k for k in one if k.startswith(f"{head}.")]
    return {k: one[k] for k in keys}, {k: many[k] for k in keys if k in many}


def gradient_factor(one: dict[str, torch.Tensor] | None, many: dict[str, torch.Tensor] | None,
                    grads: dict | None) -> float | None:
    """:func:`scale_factor` of the step-1 gradients of the model where they first differ, or None."""
    if not one or not many or grads is None or grads["passed"] or set(one) != set(many):
        return None
    return scale_factor(*_model_of(grads["first_diverging"], one, many))


def lr_differs(lrs: list[float], nproc: int = 2) -> str | None:
    """The cause when the runs stepped with different learning rates (a script that scales its lr by the world
    size): verify compares the training of one process with the N processes', and that changed it.

    >>> lr_differs([0.1, 0.2])[:62]
    'the learning rate differs: 0.1 at 1 process, 0.2 at 2 processe'
    >>> lr_differs([0.1, 0.1]) is None
    True
    """
    if len(lrs) < 2 or not all(lrs) or abs(lrs[1] - lrs[0]) <= 1e-9 * abs(lrs[0]):
        return None
    return (f"the learning rate differs: {lrs[0]:g} at 1 process, {lrs[1]:g} at {nproc} processes (a learning rate "
            "scaled by the world size, or by the per-process batch?); the global batch is the same at any N, so "
            "the learning rate should be too: compute it from the global batch, not from the number of processes")


def likely_cause(one: dict[str, torch.Tensor] | None, many: dict[str, torch.Tensor] | None, grads: dict | None,
                 random_draws: bool, nproc: int = 2, autocast: str | None = None, masked: bool | int | None = False,
                 lrs: list[float] | None = None) -> str:
    """One sentence: where the runs part (step-1 gradients or later) and why that likely is. ``one`` / ``many``:
    the runs' step-1 gradients; ``grads``: :func:`ddpkit.commands.verify.weights.compare_weights` of them (None
    without); ``masked``: a training loader without ``count=`` hands out labels of -100; ``lrs``: the largest
    learning rate each run stepped with."""
    where = "the runs part"
    said = lr_differs(lrs or [], nproc)
    if said:
        return said
    if one and many and grads is not None:
        if not grads["passed"]:
            factor = gradient_factor(one, many, grads)
            if factor is not None:
                return (f"the step-1 gradients differ by a factor of {factor:.3g} (1 process / {nproc} processes) "
                        f"from {grads['first_diverging']!r} on: a loss reduction (reduction='sum'?) or a "
                        "batch-size-dependent scale; average the loss over the batch (reduction='mean'), or scale "
                        "it by the global batch, not the per-process one")
            where = f"the step-1 gradients already differ at {grads['first_diverging']!r}"
        else:
            where = "the step-1 gradients agree, the weights part later"
    if masked:
        label = -100 if masked is True else int(masked)
        return (f"{where}: the training data holds labels of {label} (ignored tokens) and the loader has no count=: "
                "a loss that is a mean over tokens, weighted by samples, changes with the world size; build the "
                f"loader with global_batch_size=G and count=lambda batch: (labels != {label}).sum() "
                "(docs/global-batch.md)")
    if random_draws:
        return (f"{where}: random draws during a training step, outside dropout (e.g. a VAE's sampling noise, "
                "random masking) differ between 1 process and N by design: the difference may be only that; to "
                "compare exactly, make the draw optional and turn it off for verify")
    if autocast:
        return (f"{where}: the forward ran under autocast in {autocast}, whose rounding differs between one batch "
                f"of N x B and N batches of B by more than the tolerance; compare with autocast off (the script's "
                "own switch, e.g. --no-amp), or loosen --rtol / --atol")
    return (f"{where}: rank-dependent code (a branch on the rank, per-rank statistics such as BatchNorm without "
            "sync_batchnorm, a loss normalised by the local batch, an update outside backward)")


def trained_nothing(batches: int) -> str:
    """The refusal for runs the cap stopped before any update (gradient accumulation over more micro-batches
    than the cap, and no optimizer.step() yet): equal weights would be a PASS that compared nothing.

    >>> trained_nothing(5).split(" (")[0]
    'both runs trained nothing in the 5 batches they were given'
    """
    return (f"both runs trained nothing in the {batches} batches they were given (no optimizer.step() and no "
            "weight changed: gradients accumulated over more micro-batches than that, or a pass over the training "
            "loader before training, a baseline or its statistics, that read them): pass a --steps larger than the "
            "batches read before the first optimizer step (until that step, --steps K caps the training loaders at "
            "K batches in all)")



def steps_differ(steps: list[int], batches: list[int], nproc: int) -> str:
    """The refusal for runs one of which took no optimizer step while the other did: nothing to compare (runs
    that both stepped, a different number of times, are compared: a FAIL names what differs). The script steps
    by what it is handed (a batch skipped for its size, ``if x.size(0) != batch_size:
    continue``, met with the one-process run's batch of N x B; an accumulation counted in batches).

    >>> steps_differ([0, 4], [5, 5], 2)[:72]
    'the runs took different numbers of optimizer steps: 0 at 1 process (in 5'
    """
    return (f"the runs took different numbers of optimizer steps: {steps[0]} at 1 process (in {batches[0]} batches), "
            f"{steps[1]} at {nproc} processes (in {batches[1]}): the script steps by what each batch holds (a batch "
            "skipped for its size, e.g. `if x.size(0) != batch_size: continue`, meets the one-process run's batch of "
            "N x the per-process one; or steps counted in batches); give the loader global_batch_size= and read the "
            "batch's own size in the script, then verify again")


def same_micro_batches(shape: dict | None, world_sizes: list[int]) -> str | None:
    """A note when every world size compared ran the step loader's micro-batches of the one-process run's size:
    a loss that depends on a micro-batch's size (a sum) then passes, however wrong at other sizes; None otherwise.
    ``shape``: the recorded step loader's global batch and limits (None: no step loader).

    >>> same_micro_batches({"global_batch": 48, "micro_batch_size": 8, "accumulation_steps": None}, [2, 3])[-68:]
    'passes there; add a world size where they differ, e.g. --nproc 2,3,4'
    >>> same_micro_batches({"global_batch": 48, "micro_batch_size": 8, "accumulation_steps": None}, [2, 4]) is None
    True
    """
    if not shape or not isinstance(shape.get("global_batch"), int):
        return None
    global_batch, limit, steps = shape["global_batch"], shape.get("micro_batch_size"), shape.get("accumulation_steps")

    def largest(world_size: int) -> int | None:
        try:
            return largest_micro_batch(global_batch, world_size, limit, steps)
        except ValueError:  # no split at that world size
            return None

    one = largest(1)
    if one is None or any(largest(w) != one for w in world_sizes):
        return None
    other = next((w for w in range(2, min(global_batch, 64) + 1) if largest(w) not in (None, one)), None)
    hint = f"; add a world size where they differ, e.g. --nproc {','.join(map(str, sorted({*world_sizes, other})))}" \
        if other else ""
    return (f"every world size compared ({', '.join(map(str, world_sizes))}) takes micro-batches of {one} samples "
            "per process, as one process does: a loss that depends on the micro-batch size (reduction=\"sum\") "
            f"passes there{hint}")


def crash_line(run: str, script: str, output: str, nproc: int) -> str:
    """One line for a verify run that exited non-zero: the script's line, the exception, and why the run may fail
    where the script alone does not (the rank's own likely cause, as the launcher says it; the one-process run
    takes N x the per-process batch).

    >>> out = "Traceback ...\\n  File \\"/x/t.py\\", line 12, in <module>\\nRuntimeError: tensor a (16) vs b (8)\\n"
    >>> crash_line("one-process run", "/x/t.py", out, 2)[:76]
    'the one-process run failed at t.py:12 (RuntimeError: tensor a (16) vs b (8))'
    >>> crash_line("2-process run", "/x/t.py", out + "ddpkit: likely cause: a tensor sized by the batch\\n", 2)[74:]
    '; likely cause: a tensor sized by the batch'
    """
    name = os.path.basename(script)
    paths = "|".join(re.escape(p) for p in {script, os.path.abspath(script)})  # not mytrain.py, nor torch's module.py
    lines = re.findall(rf'File "(?:{paths})", line (\d+)', output)
    where = f"{name}:{lines[-1]}" if lines else name
    tail = [line.strip() for line in output.splitlines() if line.strip()]
    raised = next((line for line in reversed(tail) if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)),
                  tail[-1] if tail else "no output")
    line = f"the {run} failed at {where} ({raised[:300]})"
    said = re.search(r"ddpkit: likely cause: (.+)", output)  # (the rank's own hint, as the launcher's report gives)
    if said:
        return f"{line}; likely cause: {said.group(1).strip()[:400]}"
    if run.startswith("one-process") and re.search(r"\bsize\b|\bshape\b", raised):
        line += (f"; verify's one-process run takes the {nproc} processes' global batch ({nproc} x the per-process "
                 "batch), so a tensor sized from a fixed batch size breaks there: size it from the batch "
                 "(x.shape[0]), or give the loader global_batch_size=")
    return line


# what the runtime says of a model that trains differently at N processes, found in the N-process run's output
RUNTIME_NOTES = ("batch_first=False) got", "got a 2-D input")


def runtime_notes(output: str) -> list[str]:
    """The runtime's own notes on why N processes train differently (an RNN reading the batch as time), each once,
    from the N-process run's output: a FAIL's likeliest cause when there is one.

    >>> runtime_notes("x\\n[rank0] ddpkit: 'lstm' (LSTM, batch_first=False) got (8, 4, 2): ...\\n" * 2)
    ["ddpkit: 'lstm' (LSTM, batch_first=False) got (8, 4, 2): ..."]
    """
    found: list[str] = []
    for line in output.splitlines():
        at = line.find("ddpkit: ")
        if at >= 0 and any(n in line for n in RUNTIME_NOTES) and line[at:] not in found:
            found.append(line[at:])
    return found[:2]
