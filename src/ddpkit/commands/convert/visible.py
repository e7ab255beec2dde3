"""The GPUs a script makes visible itself (``os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)``, SparseTSF's
``_acquire_device``): under a launch of N processes each rank would see only those, and ranks would share one. The
launch chooses them instead (``CUDA_VISIBLE_DEVICES=2,3 ddpkit launch --nproc-per-node 2 ...``), each rank its own.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import os\\nos.environ['CUDA_VISIBLE_DEVICES'] = '1'\\n")
    >>> "CUDA_VISIBLE_DEVICES" in p.text, [e.what for e in p.edits][-1]
    (False, "os.environ['CUDA_VISIBLE_DEVICES'] = ... removed")
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flow import callers
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work)


def visible_devices(work: _Work) -> None:
    """``os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)`` in the script: every rank would see only that GPU,
    and all share it. Removed where it is a line of its own (said), listed elsewhere: the launch chooses the GPUs,
    each rank its own."""
    found = []  # (the statement, its line) of each such assignment that may run
    for node in m.findall(work.facts.module, m.Assign(targets=[m.AssignTarget(target=m.Subscript())])):
        assert isinstance(node, cst.Assign)
        target = node.targets[0].target
        assert isinstance(target, cst.Subscript)
        index = target.slice[0].slice if target.slice else None
        key = index.value if isinstance(index, cst.Index) else None
        if dotted(target.value) in ("os.environ", "environ") and isinstance(key, cst.SimpleString) and \
                key.evaluated_value == "CUDA_VISIBLE_DEVICES":
            stmt, scope, line = next(((st, sc, n) for st, sc, n in work.facts.statements
                                      if any(b is node for b in st.body)), (None, None, 1))
            elsewhere = work.crossing.elsewhere if work.crossing is not None else None
            if scope is not None and scope.name and elsewhere is not None and not callers(work.facts, scope) and \
                    scope.name.rsplit(".", 1)[-1] not in elsewhere:
                continue  # (SCINet's ``_acquire_device``, which nothing calls)
            found.append((stmt, line))
    if not found:
        return
    # removed only where each is a line of its own and nothing reads the variable back (review 26: a print of it,
    # ``len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))``: a KeyError once it is gone)
    mentions = work.facts.module.code.count("CUDA_VISIBLE_DEVICES")
    # (nor one that hides the GPUs, ``= ""`` / ``"-1"`` for a --cpu run: gone, the run would take the GPUs)
    hides = any(isinstance(v, cst.SimpleString) and v.evaluated_value in ("", "-1") for stmt, _ in found
                if stmt is not None for small in stmt.body if isinstance(small, cst.Assign) for v in [small.value])
    if all(stmt is not None and len(stmt.body) == 1 for stmt, _ in found) and mentions == len(found) and not hides:
        for stmt, line in found:
            work.edits.remove.add(id(stmt))
            work.note("os.environ['CUDA_VISIBLE_DEVICES'] = ... removed", "every rank would see only the GPUs it "
                      "names and share one; the launch chooses them (CUDA_VISIBLE_DEVICES=2,3 ddpkit launch "
                      "--nproc-per-node 2 ...), each rank its own", line)
        return
    work.leave(found[0][1], "the script sets CUDA_VISIBLE_DEVICES: every rank would see only the GPUs it names, "
               "and ranks would share one", "remove it and choose the GPUs for the launch instead: "
               "CUDA_VISIBLE_DEVICES=0,1 ddpkit launch --nproc-per-node 2 ...; each rank then takes its own")
