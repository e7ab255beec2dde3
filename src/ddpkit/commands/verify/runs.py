"""``ddpkit verify``'s runs of the script: each one's failure one line that names the script's line, what it saved
under the working directory removed after it (:mod:`.isolate`), and the one-process re-runs the decisions ask for
(other draws: :mod:`.draws`; initial weights perturbed by rounding: :mod:`.perturbed`).

Example::

    >>> sorted(RERUN_NAMES.values())
    ['from initial weights perturbed by rounding', 'with other random draws']
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import torch

from ddpkit.commands.logtail import run_logged
from ddpkit.commands.verify import causes, isolate
from ddpkit.core import contract
from ddpkit.core.errors import ScriptFailed

PROG = "ddpkit verify"


def reruns(script: str, script_args: Sequence[str], nproc: int, tmp: str, common: dict[str, str],
            variable: contract.Var, values: Sequence[int]) -> list[dict] | None:
    """The one-process run again with ``variable`` = each of ``values`` (other draws: :mod:`.draws`; weights
    perturbed by rounding: :mod:`.perturbed`, 0 for none): the weights each ended with (None: a re-run failed, and
    the FAIL stands as it is)."""
    others, what = [], RERUN_NAMES[variable.name]
    for k in values:
        out = os.path.join(tmp, f"single-rerun{k}.pt")
        try:
            run(script, f"one-process re-run {what}", nproc, [sys.executable, script, *script_args],
                 {**common, contract.MODE.name: "single", contract.BATCH_SCALE.name: str(nproc),
                  contract.VERIFY_OUT.name: out, variable.name: str(k)}, os.path.join(tmp, "rerun.log"))
            others.append(torch.load(out, weights_only=True))
        except (ScriptFailed, OSError):
            return None
    return others


RERUN_NAMES = {contract.VERIFY_DRAWS.name: "with other random draws",
               contract.VERIFY_PERTURB.name: "from initial weights perturbed by rounding"}


def run(script: str, run: str, nproc: int, cmd: list[str], env: dict[str, str], log: str) -> None:
    """One of verify's runs; its failure is one line naming the script's line (the temporary log goes away). What
    it writes under the working directory and the script's folder is removed after it (:mod:`.isolate`): the next
    run does not resume from its checkpoint."""
    before = isolate.listing([os.getcwd(), os.path.dirname(os.path.abspath(script))])
    try:
        run_logged(cmd, env, log)
    except ScriptFailed:
        if _caught_cap(env.get(contract.VERIFY_OUT.name, "")):
            if "caught" not in _SAID:
                _SAID.add("caught")
                print(f"{PROG}: the script caught verify's stop at the step cap (a SystemExit; a unittest test "
                      "reports it as an error) and exited with an error: the weights at the cap are compared",
                      file=sys.stderr)
            return
        shown = script  # (``-m p2ch11.training``: the module's file, not "-m")
        if script == "-m" and "-m" in cmd[:-1]:
            shown = cmd[cmd.index("-m") + 1].replace(".", os.sep) + ".py"
        with open(log, errors="replace") as f:
            raise ScriptFailed(causes.crash_line(run, shown, f.read()[-20000:], nproc)) from None
    finally:
        _undo(run, before)


def _caught_cap(out: str) -> bool:
    """The run reached the step cap and ended through its shutdown (weights and facts written), yet exited with an
    error: the script caught the cap's SystemExit (a ``unittest.TestCase`` whose test trains, set 27's VAE), and
    nothing after the cap trains (each further step stops again)."""
    try:
        with open(f"{out}.json") as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(facts, dict) and facts.get("capped") is True and facts.get("finished") is True and \
        os.path.exists(out)


def _undo(run: str, before: isolate.Listing) -> None:
    """The checkpoints the run saved removed (:mod:`.isolate`), each said once; one it saved over, named once."""
    if not before.complete and "listing" not in _SAID:
        _SAID.add("listing")
        print(f"{PROG}: more than {isolate.LIMIT} files under {', '.join(before.roots)}: the checkpoints each run "
              "saves are not removed after it, and a run that resumes from one starts where the one before stopped; "
              "run verify from a folder of the script's code alone", file=sys.stderr)
    removed, changed = isolate.undo(before)
    if removed:
        print(f"{PROG}: removed the files the {run} saved: {', '.join(map(os.path.relpath, removed[:5]))}"
              f"{' and more' if len(removed) > 5 else ''} (the next run starts without them)", file=sys.stderr)
    changed = [p for p in changed if p not in _SAID]
    _SAID.update(changed)
    if changed:
        print(f"{PROG}: the {run} saved over {', '.join(map(os.path.relpath, changed[:3]))}"
              f"{' and more' if len(changed) > 3 else ''}, a checkpoint there before verify started, which the "
              "next run reads as saved: if the script resumes from it, move it away and verify again",
              file=sys.stderr)


_SAID: set[str] = set()  # files said changed once, not once per run
