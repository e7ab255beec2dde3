"""A training loop that hands its batch to a helper of another module of the project that shows or saves it (a DCGAN
project's ``save_images(x, 'real')``, whose ``vutils.save_image`` that module's conversion makes rank 0's): sharded,
the batch is this rank's part of the global one, so the picture is rank 0's part (B/N images). Said at the call; the
helper's own file cannot know what it is handed.

Example::

    >>> from ddpkit.commands.convert.crossing import Crossing
    >>> from ddpkit.commands.convert.plan import plan
    >>> done = plan("import torch\\nfrom torch.utils.data import DataLoader\\nfrom saver import save_images\\n"
    ...             "m = torch.nn.Linear(4, 1)\\no = torch.optim.SGD(m.parameters(), lr=0.1)\\n"
    ...             "for x, y in DataLoader(ds, batch_size=8, shuffle=True):\\n    m(x).sum().backward()\\n"
    ...             "    o.step()\\n    save_images(x, 'real')\\n", crossing=Crossing(own=frozenset({"saver"})))
    >>> [k.line for k in done.kept if "this rank's part of the batch" in k.what]
    [9]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import batchnames, flow
from ddpkit.commands.convert.crossing import HANDED, key
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from

_Work = Any  # the plan in the making (plan._Work): facts, crossing, sharded, keep
SHOWS = ("save", "plot", "show", "image", "visual", "draw", "grid", "log")


def shown_batches(work: _Work) -> None:
    """Keep a line at each call, in a training loop over a loader sharded here, of a project function whose name
    shows or saves, handed the batch itself (a loop target, or one moved: ``x = x.to(device)``)."""
    handed = bool(work.crossing.provided.get(key("", HANDED)))  # (a trainer's loop over what its callers hand in)
    if not work.crossing.own or not work.sharded and not work.fed and not handed:
        return
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        batch = batchnames.batch_names(work.facts, loop)
        for call in loop.calls:
            origin = imported_from(work.facts, dotted(call.node.func) or "")
            name = origin[1].rsplit(".", 1)[-1].lower() if origin is not None else ""
            given = [str(dotted(a.value)) for a in call.node.args if dotted(a.value) in batch]
            alone = call.stmt is not None and len(call.stmt.body) == 1 and isinstance(call.stmt.body[0], cst.Expr) \
                and call.stmt.body[0].value is call.node  # (``x = normalize_images(x)`` transforms: review 34)
            if origin is not None and origin[0].split(".")[0] in work.crossing.own and given and alone and \
                    any(w in name for w in SHOWS):
                work.keep(call.line, f"{dotted(call.node.func)}({given[0]}, ...) gets this rank's part of the batch",
                          f"{given[0]} is this rank's B/N samples of the global batch: what {origin[1]} of "
                          f"{origin[0]} shows or saves from it is rank 0's part (ddpkit.gather({given[0]}) on every "
                          "rank hands it the whole batch)")


def peeks(work: _Work) -> None:
    """Keep a line at a ``print`` of the first batch's shape in a loop over a training loader sharded here that only
    looks (the PyTorch quickstart's ``for X, y in loader: print(X.shape); break``): the shape is rank 0's part of
    the global batch (B/N rows), not the batch the script trains on.

    >>> from ddpkit.commands.convert.plan import plan
    >>> done = plan("import torch\\nfrom torch.utils.data import DataLoader\\nld = DataLoader(ds, batch_size=8)\\n"
    ...             "for x, y in ld:\\n    print(x.shape)\\n    break\\nm = torch.nn.Linear(4, 1)\\n"
    ...             "o = torch.optim.SGD(m.parameters(), lr=0.1)\\nfor x, y in ld:\\n    m(x).mean().backward()\\n"
    ...             "    o.step()\\n")
    >>> [k.line for k in done.kept if "the first batch of a training loader" in k.what]
    [5]
    """
    loaders = {b.target for b in work.facts.bindings if id(b.value) in work.sharded}
    for loop in work.facts.loops:
        if not loop.breaks or not loop.iter_names & loaders or flow.trains(work.facts, loop):
            continue
        batch = batchnames.batch_names(work.facts, loop)
        for call in (c for c in loop.calls if c.last == "print" and c.loops and c.loops[-1] is loop):
            shapes = [str(dotted(n.value)) for n in m.findall(call.node, m.Attribute(attr=m.Name("shape") |
                                                                                       m.Name("size")))
                      if isinstance(n, cst.Attribute) and dotted(n.value) in batch]
            if shapes:
                work.keep(call.line, f"print(...) shows {shapes[0]}'s shape, the first batch of a training loader",
                          "sharded, that batch is rank 0's part of the global batch (B/N rows; the global batch is "
                          "N times as many)")
                break
