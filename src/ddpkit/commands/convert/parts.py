"""A container model whose parts each have their own optimizer (a GAN class holding ``self.generator`` and
``self.discriminator``, trained by ``Adam(model.generator.parameters())`` and ``Adam(model.discriminator
.parameters())``, its loop calling ``model.discriminator(x)`` and ``model.sample(n)``): each part is wrapped on its
own, ``model.generator = ddpkit.prepare_model(model.generator)``, above the first of those optimizers. A wrap of the
whole container would see none of the forwards (the parts are called, not the container), so no gradient would be
averaged; a part's own wrap runs at every call of it, from the loop or from the container's methods. The
container's ``state_dict`` keeps its keys (a prepared model's is its module's).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch.utils.data import DataLoader\\ngan = Gan()\\n"
    ...             "opt_g = torch.optim.Adam(gan.gen.parameters())\\n"
    ...             "opt_d = torch.optim.Adam(gan.disc.parameters())\\n"
    ...             "for x in DataLoader(ds, batch_size=8):\\n    gan.disc(x).mean().backward()\\n"
    ...             "    opt_d.step()\\n").text
    >>> [line for line in text.splitlines() if "prepare_model" in line]
    ['gan.gen = ddpkit.prepare_model(gan.gen)', 'gan.disc = ddpkit.prepare_model(gan.disc)']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import trained
from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work): facts, edits, note


def containers(work: _Work) -> dict[str, list[tuple[str, Call]]]:
    """{a container's name: [(a part, the optimizer over it)]} where two or more optimizers train distinct parts
    ``name.part`` of one model the script builds, and none trains it whole."""
    found: dict[str, list[tuple[str, Call]]] = {}
    whole: set[str] = set()
    for call in work.facts.calls:
        for target in trained.trained_all(work.facts, call):
            parts = target.split(".")
            if len(parts) == 2 and parts[0] != "self":
                found.setdefault(parts[0], []).append((target, call))
            else:
                whole.add(parts[0])
    return {head: pairs for head, pairs in found.items() if head not in whole and
            len({t for t, _ in pairs}) >= 2 and _built_here(work, head, pairs[0][1]) and not _whole_used(work, head)}


def _whole_used(work: _Work, head: str) -> bool:
    """The container itself runs layers or holds weights of its own: called (``gan(x)``, its forward), or its
    class of this file sets an ``nn.Parameter`` of its own (review 28: ``self.scale``, trained beside a part):
    wrapped whole, as any model."""
    called = any(dotted(c.node.func) == head for c in work.facts.calls)
    bound = binding_of(work.facts, head, work.facts.scopes[""], 1 << 30)
    cls = dotted(bound.value.func) if bound is not None and isinstance(bound.value, cst.Call) else None
    own = any(b.scope.cls == cls and b.target.startswith("self.") and isinstance(b.value, cst.Call) and
              (dotted(b.value.func) or "").endswith("Parameter") for b in work.facts.bindings) if cls else False
    return called or own


def _built_here(work: _Work, head: str, call: Call) -> bool:
    """``head`` is a model this file builds (``model = GAN()``), not a parameter or an import."""
    bound = binding_of(work.facts, head, call.scope, call.line)
    return bound is not None and isinstance(bound.value, cst.Call) and bound.stmt is not None


def wrap_parts(work: _Work, head: str, pairs: list[tuple[str, Call]]) -> None:
    """Each part wrapped above the first optimizer over one (see the module); once: a part wrapped already (a
    second convert) is left."""
    first = min((call for _, call in pairs), key=lambda c: c.line)
    wrapped = {b.target for b in work.facts.bindings if isinstance(b.value, cst.Call) and
               (dotted(b.value.func) or "").endswith("prepare_model")}
    parts = [t for t in dict.fromkeys(t for t, _ in pairs) if t not in wrapped]
    if not parts or first.stmt is None:
        return
    work.edits.before.setdefault(id(first.stmt), []).extend(
        f"{part} = ddpkit.prepare_model({part})" for part in parts)
    written = ", ".join(f"{p} = ddpkit.prepare_model({p})" for p in parts)
    work.note(f"{', '.join(parts)} wrapped each on its own: {written}",
              f"each part of {head} has its own optimizer and is called on its own: a part's wrap averages its "
              f"gradients at each call of it (a wrap of the whole {head} would see none of those calls)", first.line)
