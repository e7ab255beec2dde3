"""What a device expression of a script says: its string (``"cuda"``, ``torch.device("cuda:0")``'s), whether a
binding is a device set-up, and what ``ddpkit.init(...)`` needs to pick the device it picked (``cpu=...``). The
rewrite of the set-up is :mod:`ddpkit.commands.convert.device`'s.

Example::

    >>> init_arguments(cst.parse_expression('torch.device("cuda" if torch.cuda.is_available() else "cpu")'))
    ''
    >>> init_arguments(cst.parse_expression('torch.device(args.device)'))
    'cpu=torch.device(args.device).type == "cpu"'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.names import dotted, resolve

ACCELERATORS = ("cuda", "mps", "xpu", "accelerator")  # "accelerator": torch.accelerator.current_accelerator()
AVAILABLE = ("cuda.is_available", "mps.is_available", "accelerator.is_available")
PROGRESS = ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.std.tqdm")


def text_of(node: cst.BaseExpression) -> str | None:
    """A device string: ``"cuda"``, or ``torch.device("cuda")``'s; ``"accelerator"`` for
    ``torch.accelerator.current_accelerator()`` (and its ``.type``)."""
    if isinstance(node, cst.Attribute) and node.attr.value == "type":
        node = node.value
    if isinstance(node, cst.Call) and (dotted(node.func) or "").endswith("accelerator.current_accelerator"):
        return "accelerator"
    if isinstance(node, cst.Call) and dotted(node.func) in ("torch.device", "device") and len(node.args) == 1:
        node = node.args[0].value
    # ``"cuda:{}".format(args.gpu)`` (Informer's experiment classes), ``f"cuda:{args.gpu}"``: the device's kind
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "format":
        node = node.func.value
    # ``"cuda:" + str(args.device)`` (powerful-gnns), ``"cuda:%d" % args.gpu``: the string on the left is the kind
    while isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Modulo)):
        node = node.left
    if isinstance(node, cst.FormattedString) and node.parts and isinstance(node.parts[0], cst.FormattedStringText):
        return node.parts[0].value
    return node.evaluated_value if isinstance(node, cst.SimpleString) else None  # type: ignore[return-value]


def branches(value: cst.BaseExpression) -> list[str]:
    """``"cuda" if a else "mps" if b else "cpu"``: ["cuda", "mps", "cpu"] ("" for a branch that is no string)."""
    found = []
    while isinstance(value, cst.IfExp):
        found.append(text_of(value.body) or "")
        value = value.orelse
    return [*found, text_of(value) or ""]


def as_string(value: cst.BaseExpression | None) -> bool:
    """A device given as a string (``"cuda" if ... else "cpu"``, ``"cuda"``), not a ``torch.device``: the script may
    test it as one (``'cuda' in device``, ``device.startswith('cuda')``), so its converted value is
    ``state.device.type``, a string too (``"cuda"``: the rank's own GPU, which ``init()`` made the current one).

    >>> expr = cst.parse_expression
    >>> as_string(expr('"cuda" if ok else "cpu"')), as_string(expr('torch.device("cpu")'))
    (True, False)
    """
    while isinstance(value, cst.IfExp):
        if not as_string(value.body):
            return False
        value = value.orelse
    return isinstance(value, cst.SimpleString) or isinstance(value, cst.Attribute) and value.attr.value == "type"


def kind_of(text: str) -> str:
    return "cpu" if text.startswith("cpu") else "accelerator" if text.startswith(ACCELERATORS) else ""


def is_device(value: cst.BaseExpression | None, target: str, aliases: dict[str, str]) -> bool:
    """``torch.device(...)``, ``"cuda" if ... else "cpu"`` (either way round, or of ``torch.device`` calls), or
    a device string bound to a ``*device`` name."""
    if isinstance(value, cst.Call) and text_of(value) != "accelerator":  # (a fixed torch.device("cpu") is a
        # set-up only as the script's ``device``)
        fixed = text_of(value) is not None and kind_of(text_of(value) or "") == "cpu"
        return resolve(dotted(value.func), aliases) == "torch.device" and \
            (not fixed or target.split(".")[-1] == "device")
    if isinstance(value, cst.IfExp):  # "cuda" if a else "mps" if b else "cpu"; "cpu" if a else "cuda" if b ...
        kinds = [kind_of(b) for b in branches(value)]
        if kinds[0] == "" and available(value.test) and isinstance(value.body, cst.Call) and \
                resolve(dotted(value.body.func), aliases) == "torch.device":
            kinds[0] = "accelerator"  # (InfoGAN's ``torch.device(args.device) if cuda.is_available() else ...``)
        return "" not in kinds and kinds.count("cpu") == 1 and kinds[0] != kinds[-1] and \
            (kinds[-1] == "cpu" or kinds[0] == "cpu")
    text = text_of(value) if value is not None else None
    return "device" in target.lower() and text is not None and kind_of(text) != ""


def init_arguments(value: cst.BaseExpression) -> str:
    """What ``ddpkit.init(...)`` needs to pick the device the script picked: nothing where it picks an
    accelerator when there is one (ddpkit does too, one per rank), ``cpu=...`` where the script can be told
    to stay on the CPU."""
    module = cst.Module(body=[])
    if isinstance(value, cst.Call) and value.args:
        inner = value.args[0].value
        if isinstance(inner, (cst.IfExp, cst.SimpleString)):
            return init_arguments(inner)
        return f'cpu=torch.device({module.code_for_node(inner)}).type == "cpu"'
    if isinstance(value, cst.IfExp):
        test, on_cpu = value.test, kind_of(text_of(value.body) or "") == "cpu"  # "cpu" if args.no_cuda else "cuda"
        if not on_cpu and available(test):
            return ""
        return cpu_when(test, not on_cpu)
    text = text_of(value) if isinstance(value, cst.SimpleString) else None
    return "cpu=True" if text is not None and text.startswith("cpu") else ""


def flag_of(value: Any) -> Any:
    """The script's own pick where a GPU is available (``torch.device(args.device) if torch.cuda.is_available() else
    ...``, ``torch.device(args.device if torch.cuda.is_available() else "cpu")``): init() gives each rank its own
    there; None where that branch is a literal."""
    if isinstance(value, cst.Call) and value.args and isinstance(value.args[0].value, cst.IfExp):
        value = value.args[0].value
    if not isinstance(value, cst.IfExp) or not available(value.test):
        return None
    body = value.body.args[0].value if isinstance(value.body, cst.Call) and value.body.args else value.body
    return None if isinstance(body, cst.SimpleString) else value.body


def available(test: cst.BaseExpression) -> bool:
    """``torch.cuda.is_available()`` and the like: ddpkit asks that itself, no ``cpu=`` needed."""
    return isinstance(test, cst.Call) and (dotted(test.func) or "").endswith(AVAILABLE)


def cpu_when(test: cst.BaseExpression, negate: bool) -> str:
    """``cpu=test`` (``cpu=not test`` when the test picks the accelerator), in parentheses where needed."""
    code = cst.Module(body=[]).code_for_node(test)
    simple = isinstance(test, (cst.Name, cst.Attribute, cst.Call))
    if negate:
        return f"cpu=not {code}" if simple else f"cpu=not ({code})"
    return f"cpu={code}" if simple else f"cpu=bool({code})"
