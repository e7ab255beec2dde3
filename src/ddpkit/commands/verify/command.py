"""``ddpkit verify script.py [args]``: does N-process training compute what one process would?

Runs the script twice for K optimizer steps with the same seed and arguments: once as one process with
the global batch (N x the per-process batch), once as N processes, then compares the final weights.

What the script needs (ddpkit scripts usually have it already): ``ddpkit.prepare_model`` for the model and
``ddpkit.data_loader`` for the training data. Nothing else: both runs start from the same initial weights
(the one-process run hands its own to the other, so the script need not seed), training loaders drop the
last ``len % N`` samples in both runs (padding would repeat samples only the N-process run sees), dropout
layers get p=0 (``--keep-dropout`` to leave them), and TF32 is off on GPUs. The runs talk to ddpkit through
the variables of :mod:`ddpkit.core.contract` (read by :mod:`ddpkit.commands.verify.hooks`). A PASS needs every
weight finite in both runs (:func:`ddpkit.commands.verify.weights.non_finite`): ``NaN > tol`` is False,
so a plain tolerance test would pass a diverged run.

Example::

    ddpkit verify --nproc-per-node 2 --steps 5 examples/digits.py
    ddpkit verify --json examples/digits.py      # one JSON object on stdout
    ddpkit verify --nproc 1,2,3 train.py         # 2 and then 3 processes, each against one process
    ddpkit verify --mode fsdp examples/digits.py # sharded training against one process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

import torch

from ddpkit.commands import itself
from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.commands.verify import causes, draws, isolate, matched, noise, outputs, perturbed, rounding, runs
from ddpkit.commands.verify.lines import fail_line, pass_line, run_length
from ddpkit.commands.verify.weights import compare_weights, gradients_apart, moved_within
from ddpkit.core import contract
from ddpkit.core.environment import visible_gpus
from ddpkit.core.errors import CANNOT_COMPARE, NOT_EQUIVALENT, SCRIPT_FAILED, UsageError
from ddpkit.strategies import table as strategy

PROG = "ddpkit verify"


class CannotCompare(RuntimeError):
    """The one-process run shows the script cannot be compared (exit :data:`CANNOT_COMPARE`)."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Compare N-process training with one process on the global batch.")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes for the distributed run (default 2, on the CPU where fewer GPUs are usable)")
    p.add_argument("--nproc", type=_counts, default=None, metavar="N,N,...",
                   help="world sizes to compare with one process in turn, e.g. 1,2,3 (1 is the reference); for "
                        "a global_batch_size= loader every one trains the same steps")
    p.add_argument("--device", default=None, help="auto (default), cpu or cuda: where both runs train")
    multi = [name for name, mode in sorted(strategy.STRATEGIES.items()) if mode.multi_process]
    p.add_argument("--mode", default="ddp", help=f"the multi-process mode to check: {', '.join(multi)} (default ddp)")
    p.add_argument("--keep-dropout", action="store_true", help="leave dropout on (the runs then differ by design)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--json", action="store_true", help="print one JSON object (one line per world size)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m (as launch)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def _counts(text: str) -> list[int]:
    """``--nproc 1,2,3`` -> the world sizes to compare with the reference, 1 (the reference itself) left out.

    >>> _counts("1,2,3"), _counts("3,2")
    ([2, 3], [3, 2])
    """
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes like 1,2,3; got {text!r}")
    return [n for n in dict.fromkeys(counts) if n > 1]


def plan(nproc: int | None, device: str | None, gpus: int) -> tuple[int, str | None, str | None]:
    """(processes, device for the runs, a note to print) from the flags and the usable GPU count.

    NCCL cannot put two ranks on one GPU: where fewer GPUs are usable than processes, an unset
    ``--device`` means the CPU (and says so); ``--device cuda`` is then an error.

    >>> plan(None, None, 0), plan(None, None, 1)[:2], plan(None, None, 4)
    ((2, None, None), (2, 'cpu'), (2, None, None))
    """
    count = 2 if nproc is None else nproc
    if device == "cpu" or gpus == 0 or count <= gpus:
        return count, device, None
    if device == "cuda":
        fewer = f"at most {gpus} processes or " if gpus >= 2 else ""
        raise UsageError(f"--device cuda with {count} processes needs {count} GPUs, {gpus} usable; "
                         f"pass {fewer}--device cpu")
    return count, "cpu", f"{gpus} GPU(s) usable for {count} processes: both runs train on the CPU (--device cpu)"


def run_env(tmp: str, nproc: int, steps: int, device: str | None, keep_dropout: bool) -> dict[str, str]:
    """The variables both runs get: steps, shared initial weights, drop semantics, dropout, no TF32, device."""
    # the workers load verify's hooks by module (no installed metadata needed: a checkout on PYTHONPATH works)
    env = {contract.TOOL.name: "ddpkit.commands.verify.hooks:from_env",
           contract.MAX_STEPS.name: str(steps), contract.VERIFY_INIT.name: os.path.join(tmp, "init.pt"),
           contract.VERIFY_DROP.name: str(nproc), contract.TF32_OVERRIDE.name: "0",
           contract.OMP_THREADS.name: os.environ.get(contract.OMP_THREADS.name, "1"),
           # (both runs, every rank: one order of a set of strings, as one process has)
           contract.HASH_SEED.name: os.environ.get(contract.HASH_SEED.name, "1")}
    if keep_dropout:
        env[contract.KEEP_DROPOUT.name] = "1"
    if device:
        env[contract.DEVICE.name] = device
    return env


def verify(script: str, script_args: Sequence[str], nproc: int, steps: int, atol: float, rtol: float,
           device: str | None = None, keep_dropout: bool = False, mode: str = "ddp", float64: bool = False,
           match: bool = False) -> dict:
    """Run both trainings in a temporary directory and compare them; :class:`CannotCompare` when the
    one-process run shows there is nothing comparable (checked before the N-process run starts). ``float64``,
    ``match``: the re-runs of :mod:`~ddpkit.commands.verify.rounding` and :mod:`~ddpkit.commands.verify.matched`."""
    with tempfile.TemporaryDirectory(prefix=isolate.OWN) as tmp:
        ref, dist_out = os.path.join(tmp, "single.pt"), os.path.join(tmp, "ddp.pt")
        common = run_env(tmp, nproc, steps, device, keep_dropout)
        if float64:
            common[contract.VERIFY_F64.name] = "1"
        if match:
            common[contract.VERIFY_MATCHED.name] = "1"
        runs.run(script, "one-process run", nproc, [sys.executable, script, *script_args],
             {**common, contract.MODE.name: "single", contract.BATCH_SCALE.name: str(nproc),
              contract.VERIFY_OUT.name: ref}, os.path.join(tmp, "single.log"))
        why = causes.refusal(outputs.facts(ref))
        if why:
            raise CannotCompare(why)
        # the mode in the environment too: launch refuses a --mode that contradicts an exported DDPKIT_MODE
        # its workers' logs in the temporary folder: not a runs/logs/ left in the user's folder by each verify
        launch = itself.command("launch", "--nproc-per-node", str(nproc), "--mode", mode,
                                "--log-dir", os.path.join(tmp, "logs"))
        runs.run(script, f"{nproc}-process run", nproc, [*launch, script, *script_args],
             {**common, contract.MODE.name: mode, contract.VERIFY_OUT.name: dist_out}, os.path.join(tmp, "ddp.log"))
        facts = [outputs.facts(ref) or {}, outputs.facts(dist_out) or {}]
        with open(os.path.join(tmp, "ddp.log"), errors="replace") as f:
            notes = causes.runtime_notes(f.read())  # (closeheat's LSTM reading the batch as time: said at the FAIL)
        if not os.path.exists(ref) or not os.path.exists(dist_out):
            raise CannotCompare(causes.refusal(facts[1], f"{nproc}-process run") or causes.NEEDS_MODEL)
        one, many = (torch.load(path, weights_only=True) for path in (ref, dist_out))
        start = outputs.initial(os.path.join(tmp, "init.pt"), int(facts[0].get("models") or 0))
        lr = max(float(f.get("lr") or 0.0) for f in facts)
        taken = max(int(f.get("steps") or 0) for f in facts)
        # elements whose gradients were only float noise in both runs, within what the optimizer can move them
        peaks = outputs.grads(ref, "gradpeak") or {}, outputs.grads(dist_out, "gradpeak") or {}
        skip = noise.noise_mask(one, many, *peaks, noise.step_bound(taken, lr))
        if taken == 0 and start is not None and outputs.unchanged(one, start):  # capped before any update: vacuous
            raise CannotCompare(causes.trained_nothing(int(facts[0].get("batches") or 0)))
        counts = [int(f.get("steps") or 0) for f in facts]
        if counts[0] != counts[1] and 0 in counts:  # (SN-GAN skips a batch of another size than its flag: all, at 1)
            raise CannotCompare(causes.steps_differ(counts, [int(f.get("batches") or 0) for f in facts], nproc))
        result = compare_weights(one, many, atol, rtol, labels=("1 process", f"{nproc} processes"), initial=start,
                                 skip=skip)
        if result["passed"] and taken and start is not None:  # (equal weights that never moved prove nothing)
            result = {**result, **_by_gradients(ref, dist_out, taken, start, one, (atol, rtol), facts)}
        result["lr"], result["notes"] = lr, notes
        result["capped"] = all(f.get("capped") for f in facts)
        result["steps_taken"], result["cap"] = taken, facts[0].get("cap")
        result["batches"] = int(facts[0].get("batches") or 0)
        result["steps_shape"] = facts[0].get("steps_shape")
        result["optimizers"] = sorted({o for f in facts for o in f.get("optimizers") or ()})
        result["random_draws"] = any(f.get("random_draws") for f in facts)
        result["draw_sources"] = sorted({s for f in facts for s in f.get("draw_sources") or ()})
        result["loader_workers"] = any(f.get("loader_workers") for f in facts)  # their draws are not seen
        result["unrepeatable"] = any(f.get("unrepeatable") for f in facts)  # a sample's own generator: not seen
        result["matchable"] = all(f.get("matchable", True) for f in facts)
        result["autocast"] = next((f["autocast"] for f in facts if f.get("autocast")), None)
        result.update(matched.counts(facts))
        if not match and matched.worth_rerun(result):  # the draws matched: a correct script then compares exactly
            again = _matched(script, script_args, nproc, steps, atol, rtol, device, keep_dropout, mode, float64)
            if again is not None and again["passed"]:
                return matched.decided({**result, "nproc": nproc}, again)
            result["matched_defect"] = matched.defect(again) if again is not None else None
        if draws.worth_rerun(result) and not match:  # how far the one-process run moves with other draws alone
            others = runs.reruns(script, script_args, nproc, tmp, common, contract.VERIFY_DRAWS,
                             range(1, draws.RERUNS + 1))
            result["draws"] = draws.measure(one, many, others, skip, atol, rtol) if others is not None else None
            if result["draws"] is not None and not result["draws"]["reached"]:
                result["random_draws"] = False  # draws that move no weight are no cause of the difference
            elif result["draws"] is not None:
                result["random_draws"] = True  # the loader workers' draws (a Dataset's augmentation) moved them
                result["draws"]["sources"] = draws.named(result["draw_sources"], result["loader_workers"],
                                                          result["unrepeatable"])
        if not result["passed"] and result["unrepeatable"] and not (result.get("draws") or {}).get("reached"):
            raise CannotCompare(UNREPEATABLE)  # other draws do not move such a generator: no spread to judge by
        if not result["passed"] and not result["non_finite"]:
            g1, gn = (outputs.grads(path) for path in (ref, dist_out))
            grads = compare_weights(g1, gn, atol, rtol) if g1 and gn else None
            result["first_gradient_diverging"] = grads.get("first_diverging") if grads else None
            result["gradient_gap"] = causes.gradient_gap(g1, gn) if g1 and gn else None
            result["gradient_factor"] = causes.gradient_factor(g1, gn, grads)
            result["lrs"] = [float(f.get("lr") or 0.0) for f in facts]
            result["cause"] = causes.likely_cause(g1, gn, grads, result["random_draws"], nproc, result["autocast"],
                                                  next((f["masked_labels"] for f in facts if f.get("masked_labels")),
                                                       None), result["lrs"])
            if float64 and perturbed.worth_measuring(result, match):
                floors = runs.reruns(script, script_args, nproc, tmp, common, contract.VERIFY_PERTURB,
                                 range(perturbed.RERUNS + 1))
                result["floor"] = perturbed.measure(one, many, floors, (atol, rtol)) if floors is not None else None
    return {"nproc": nproc, "mode": mode, "steps": steps, "atol": atol, "rtol": rtol, **result}


UNREPEATABLE = ("the training samples differ between the runs: a process's first sample came out different when "
                "fetched twice with every generator seeded (augmentation from a generator of the dataset's own, such "
                "as albumentations' Compose without seed= or a np.random.default_rng() it keeps, whose draws follow "
                "the order of the fetches); to compare exactly, draw it from torch, numpy or random in __getitem__, "
                "or turn the augmentation off for verify")


UNREPEATED = ("the one-process run, run again unchanged, did not end where it did: a draw verify cannot see or seed "
              "(an unseeded generator of the script's own, a draw before ddpkit starts) moves the weights from run to "
              "run, so the runs cannot be compared exactly; seed it (torch.manual_seed before the draw) and verify "
              "again")


def _matched(script: str, script_args: Sequence[str], nproc: int, steps: int, atol: float, rtol: float,
             device: str | None, keep_dropout: bool, mode: str, float64: bool) -> dict | None:
    """Both runs again with their steps' draws matched, and in float64 too when that differs by what rounding
    makes (a GAN's BatchNorm under Adam); None when a re-run could not run (the first result stands)."""
    print(f"{PROG}: the runs differ and their steps drew from torch's generator: both run again with the draws "
          "matched (each draw of the batch's size made once for the global batch, each process taking its rows)",
          file=sys.stderr, flush=True)
    try:
        again = verify(script, script_args, nproc, steps, atol, rtol, device, keep_dropout, mode, float64, True)
        # rounding parts the step-1 gradients by a fraction of their size (0.13 at worst in a badly conditioned
        # BatchNorm); a gap beyond their size is a defect, not worth a third pair of runs
        # draws the mode left to the global generator (a loader's seed at iter(), randperm) are no bar here: the
        # float64 pair tells the rounding of a GAN's BatchNorm under Adam from the rest
        if not float64 and rounding.worth_rerun({**again, "random_draws": False}) and \
                (again.get("gradient_gap") or 0.0) < 1.0:
            print(f"{PROG}: the matched runs differ and {rounding.why_rerun(again)}: both run again in float64",
                  file=sys.stderr, flush=True)
            again = rounding.decided(again, verify(script, script_args, nproc, steps, atol, rtol, device,
                                                   keep_dropout, mode, True, True))
        if not again.get("passed"):  # how far, so that what decides next can be weighed (a GAN's lesson)
            diff = again.get("first_max_abs_diff", again.get("max_abs_diff"))
            print(f"{PROG}: with the draws matched the runs still differ ({again.get('first_diverging')!r}, max abs "
                  f"diff {'n/a' if diff is None else format(diff, '.3g')}"
                  f"{'; ' + again['rounding_note'] if again.get('rounding_note') else ''}); the other tests decide",
                  file=sys.stderr, flush=True)
    except (CannotCompare, RuntimeError) as exc:  # said: the other tests decide, and the line says why
        print(f"{PROG}: the re-run with the draws matched could not run ({_shortened(str(exc))}); the other tests "
              "decide",
              file=sys.stderr, flush=True)
        return None
    return again




def _by_gradients(ref: str, dist_out: str, taken: int, start: dict, one: dict, tol: tuple[float, float],
                  facts: list[dict]) -> dict:
    """The verdict of runs whose trained weights moved less than the tolerance: their learning rates' and their
    step-1 gradients' (:func:`~ddpkit.commands.verify.weights.gradients_apart`); CannotCompare when no gradients
    were recorded; nothing (the weights' verdict stands) when the weights moved."""
    g1, gn = outputs.grads(ref), outputs.grads(dist_out)
    if not moved_within(start, one, *tol, set(g1) if g1 else set(one)):
        return {}
    lrs = [float(f.get("lr") or 0.0) for f in facts]
    if abs(lrs[0] - lrs[1]) > 1e-6 * max(abs(lrs[0]), abs(lrs[1])):  # (``lr = args.lr * world_size``)
        return {"passed": False, "first_diverging": next(iter(g1 or one)), "first_max_abs_diff": None,
                "gradients_decided": True, "reason": f"the weights moved less than the tolerance, and the learning "
                f"rates differ: {lrs[0]:g} (1 process) vs {lrs[1]:g} (N processes)"}
    if not g1 or not gn:
        raise CannotCompare(f"the weights moved less than the tolerance in {taken} step(s) (a warm-up's tiny learning "
                            "rate?): equal weights prove nothing, and no step-1 gradients were recorded to compare; "
                            "run more steps (--steps) or with a larger learning rate")
    return gradients_apart(g1, gn) or {"gradients_decided": True}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if ns.nproc is not None and ns.nproc_per_node is not None:
            raise UsageError("--nproc and --nproc-per-node both given; pass one (--nproc 1,2,3 compares each)")
        if ns.nproc == []:
            raise UsageError("--nproc lists no world size above 1; pass e.g. --nproc 1,2,3")
        gpus = 0 if ns.device == "cpu" else visible_gpus()
        plans = [plan(n, ns.device, gpus) for n in (ns.nproc or [ns.nproc_per_node])]
        if not strategy.get(ns.mode, UsageError).multi_process:
            raise UsageError(f"--mode {ns.mode} runs one process; verify compares a multi-process mode "
                             f"({', '.join(n for n, s in sorted(strategy.STRATEGIES.items()) if s.multi_process)})")
        fewest = min(count for count, _, _ in plans)
        if fewest < 2 or ns.steps < 1 or not (ns.module or os.path.isfile(ns.script)):
            raise UsageError(f"need processes >= 2, --steps >= 1 and an existing script; got "
                              f"{fewest}, {ns.steps}, {ns.script!r}")
        if ns.module:  # both runs as `python -m MODULE` / `ddpkit launch -m MODULE`: "-m" leads the arguments
            ns.script, ns.script_args = "-m", [ns.script, *ns.script_args]
    except UsageError as exc:
        return usage_error(PROG, exc)
    results: list[dict] = []
    codes = [_verify_one(ns, nproc, device, note, results) for nproc, device, note in plans]
    if results and all(r["passed"] for r in results):  # a PASS that could not have seen a micro-batch-size bug
        same = causes.same_micro_batches(results[0].get("steps_shape"), [r["nproc"] for r in results])
        if same:
            print(f"{PROG}: note: {same}", file=sys.stderr, flush=True)
    # a FAIL at any world size decides, then the first world size that did not pass (--nproc 2,3 and 3,2 alike)
    return NOT_EQUIVALENT if NOT_EQUIVALENT in codes else next((code for code in codes if code), 0)


def _verify_one(ns: argparse.Namespace, nproc: int, device: str | None, note: str | None,
                results: list[dict]) -> int:
    """One world size against one process: its lines, and its exit code; its result appended to ``results``."""
    for line in filter(None, [note, f"training loaders drop the last len % {nproc} samples in both runs "
                              "(padding would repeat samples only the N-process run sees)",
                              None if ns.keep_dropout else "dropout is off in both runs (--keep-dropout to keep it)"]):
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    try:
        result = verify(ns.script, ns.script_args, nproc, ns.steps, ns.atol, ns.rtol, device, ns.keep_dropout,
                        ns.mode)
    except (CannotCompare, RuntimeError) as exc:
        cannot = isinstance(exc, CannotCompare)
        print(f"{PROG}: {'cannot compare' if cannot else 'error'}: {exc}", file=sys.stderr)
        if ns.json:  # one line per world size, this one's too
            print(json.dumps({"nproc": nproc, "mode": ns.mode, "passed": False,
                              "error": "cannot compare" if cannot else "a run failed", "reason": str(exc)}))
        return CANNOT_COMPARE if cannot else SCRIPT_FAILED
    if rounding.worth_rerun(result):
        print(f"{PROG}: the runs differ and {rounding.why_rerun(result)}: both run again in float64 "
              "(float rounding or a defect?)", file=sys.stderr, flush=True)
        try:
            result = rounding.decided(result, verify(ns.script, ns.script_args, nproc, ns.steps, ns.atol, ns.rtol,
                                                     device, ns.keep_dropout, ns.mode, float64=True))
        except (CannotCompare, RuntimeError) as exc:
            result = rounding.decided(result, None, str(exc))
    if result.get("draws") and result["draws"]["reached"]:  # draws that moved no weight left the cause as it was
        verdict, line = draws.decided(result["draws"])
        if verdict == "cannot compare" and result.get("matched_defect"):  # within the draws' spread, yet the
            verdict, line = "fail", result["matched_defect"]  # draws matched apart beyond rounding: a defect
        result["cannot_compare"] = verdict == "cannot compare"
        if result["cannot_compare"]:  # as every "cannot compare" is said: the line on stderr, error and reason
            result["error"], result["reason"] = "cannot compare", line
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)
        else:
            result["cause"] = line
    floor = result.get("floor") or {}
    apart = (result.get("float64_apart") or {}).get("diff") or result.get("max_abs_diff") or 0.0
    # (only where the control's own drift reaches the gap: a gap far beyond it is a FAIL still, review 43's per-rank
    # BatchNorm beside one unseeded draw that moved a statistic by 1e-9)
    if not result["passed"] and not result.get("cannot_compare") and floor.get("unrepeatable") and \
            apart <= 10 * floor.get("control_diff", float("inf")):
        # (the one-process run ran again unchanged ended elsewhere: a FAIL against it says nothing; set 27's cGAN,
        # whose fixed noise an unseeded draw made, moving BatchNorm's statistics differently in every run)
        result["cannot_compare"], result["error"], result["reason"] = True, "cannot compare", UNREPEATED
        print(f"{PROG}: cannot compare exactly: {UNREPEATED}", file=sys.stderr, flush=True)
    results.append(result)
    if ns.json:
        print(json.dumps(result), flush=True)
    elif result["passed"]:
        print(pass_line(result, nproc, ns.mode), flush=True)
        if result.get("rounding_note"):
            print(f"  {result['rounding_note']}", flush=True)
        if result["excused"]:
            print(f"  {noise.excused_line(result['excused'], result['excused_in'], result['lr'])}; "
                  f"their max abs diff {result['excused_max_diff']:.3g}")
    elif result["non_finite"]:
        print(f"FAIL after {run_length(result)}: {result['reason']}", flush=True)
    elif result.get("cannot_compare"):  # said on stderr, as every "cannot compare" is
        pass
    else:
        print(fail_line(result, ns.steps, ns.atol, ns.rtol), flush=True)
        for note in result.get("notes") or ():
            print(f"  the {nproc}-process run said: {note}", flush=True)
        if result.get("rounding_note"):
            print(f"  {result['rounding_note']}", flush=True)
    return 0 if result["passed"] else CANNOT_COMPARE if result.get("cannot_compare") else NOT_EQUIVALENT


def _shortened(text: str, most: int = 1200) -> str:
    """``text`` whole up to ``most`` characters; beyond, cut after its last full sentence or clause that fits (a
    cause cut mid-word, "(an", says nothing).

    >>> _shortened("a b. c d", most=6)
    'a b. ...'
    """
    if len(text) <= most:
        return text
    cut = max(text.rfind(mark, 0, most) for mark in (". ", "; ", ": "))
    return (text[:cut + 1] if cut > 0 else text[:most]) + " ..."
