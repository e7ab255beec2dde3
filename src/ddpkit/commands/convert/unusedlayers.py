"""Layers a model's class builds and no forward reaches (a leftover decoder ``self.spare = nn.Linear(4, 16)``, read
only by a method nothing calls): their parameters get no gradient, and DDP stops at the first backward unless
it is told to look for them. The wrap passes ``find_unused_parameters=True`` and says which layers.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("import torch.nn as nn\\nclass AE(nn.Module):\\n    def __init__(self):\\n"
    ...                    "        super().__init__()\\n        self.enc = nn.Linear(2, 2)\\n"
    ...                    "        self.old = nn.Linear(2, 2)\\n    def old_path(self, x):\\n"
    ...                    "        return self.old(x)\\n"
    ...                    "    def forward(self, x):\\n        return self.enc(x)\\n"))
    >>> unused(facts, cst.parse_expression("AE()"))
    ['self.old']
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Facts


def unused(facts: Facts, value: cst.BaseExpression | None) -> list[str]:
    """The ``self.X`` layers the class ``value`` builds (``AE()``, a class of this file) in ``__init__`` that no
    method reached from ``forward`` (through ``self.method(...)``) reads; [] when unknown."""
    cls = dotted(value.func) if isinstance(value, cst.Call) else None
    init, forward = facts.scopes.get(f"{cls}.__init__"), facts.scopes.get(f"{cls}.forward")
    if init is None or forward is None:
        return []
    layers = [b.target for b in facts.bindings if b.scope is init and b.target.startswith("self.") and
              b.target.count(".") == 1 and isinstance(b.value, cst.Call) and
              (dotted(b.value.func) or "").split(".")[-1][:1].isupper() and
              (dotted(b.value.func) or "").split(".")[-1] not in NO_PARAMETERS]
    # (a layer ``__init__`` puts in another, ``self.net = nn.Sequential(self.fc1, ...)``: reached through it)
    held = {n for b in facts.bindings if b.scope is init and b.value is not None for n in names_in(b.value)}
    reached, todo = {forward.name}, [forward]
    while todo:  # (forward and the methods it calls on self, and theirs)
        scope = todo.pop()
        for c in facts.calls:
            name = f"{cls}.{c.last}"
            if c.scope is scope and dotted(c.node.func) == f"self.{c.last}" and name in facts.scopes and \
                    name not in reached:
                reached.add(name)
                todo.append(facts.scopes[name])
    read = {n for n, scope, _line, _node in facts.reads if scope.name in reached}
    # (``for layer in self.layers``, ``getattr(self, name)``, ``self.modules()``: reached in ways not followed)
    loose = any(c.scope.name in reached and c.last in ("getattr", "modules", "children", "named_children",
                                                        "named_modules") for c in facts.calls)
    if loose or any(m.findall(facts.scopes[n].node, m.Call(func=m.Name("getattr"))) for n in reached):
        return []
    # (or reached from outside the class, ``gan.disc(fake)`` of a GAN container: a use convert does not weigh here)
    outside = {n.split(".", 1)[1] for n, scope, _line, _node in facts.reads if scope.cls != cls and "." in n}
    return [layer for layer in dict.fromkeys(layers) if layer not in held and
            not any(r == layer or r.startswith(f"{layer}.") for r in read) and
            not any(o == layer[5:] or o.startswith(f"{layer[5:]}.") for o in outside)]


# torch's layers that hold no parameters (an unused ``self.relu = nn.ReLU()`` costs DDP nothing; review 44)
NO_PARAMETERS = {"ReLU", "ReLU6", "LeakyReLU", "PReLU6", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid",
                 "Tanh", "Softmax", "LogSoftmax", "Softplus", "Hardtanh", "Hardswish", "Hardsigmoid", "Dropout",
                 "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten", "Unflatten",
                 "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
                 "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "Upsample",
                 "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle", "ZeroPad2d", "ReflectionPad2d",
                 "CrossEntropyLoss", "MSELoss", "BCELoss", "BCEWithLogitsLoss", "L1Loss", "NLLLoss"}
