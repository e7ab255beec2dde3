"""The one-process multi-GPU idioms of public scripts, undone so that ``prepare_model`` does their job:
``net = nn.DataParallel(net)`` (usually under ``if use_cuda:`` or ``if torch.cuda.device_count() > 1:``) and
``nn.parallel.data_parallel(self.main, input, range(self.ngpu))`` in a ``forward``.

``prepare_model`` already wraps in DataParallel for one process on several GPUs and in DDP under ``ddpkit
launch``: the mode comes from the launch. Kept, the script's own wrapper would go inside ddpkit's (DataParallel
inside DDP: every rank driving every GPU) or only on one path (the ``if``). So ``x = DataParallel(x)`` is
deleted, a ``DataParallel(m)`` inside an expression becomes ``m``, ``data_parallel(module, inputs, ...)`` becomes
``module(inputs)``, and ``model.module`` (the wrapper's module, which a plain model has not) becomes
``ddpkit.unwrap(model)``. ``DistributedDataParallel`` and ``torch.distributed`` stay refused (plan.py).

Example::

    >>> is_wrapper("torch.nn.DataParallel"), is_wrapper("torch.nn.parallel.DistributedDataParallel")
    (True, False)
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.rules import without_moves
from ddpkit.commands.convert.scan import Call

WRAPPERS = ("torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
            "torch.nn.parallel.data_parallel.DataParallel")
FUNCTIONS = ("torch.nn.parallel.data_parallel", "torch.nn.parallel.data_parallel.data_parallel")

# the plan in the making (plan._Work): facts, edits, note, leave, models
_Work = Any


def is_wrapper(name: str | None) -> bool:
    return name in WRAPPERS


def single_process(name: str | None) -> bool:
    """A call this module undoes: it spreads one process over several GPUs, which prepare_model does too."""
    return name in WRAPPERS or name in FUNCTIONS


def inner(value: cst.BaseExpression | None, aliases: dict[str, str]) -> cst.BaseExpression | None:
    """``m`` of ``DataParallel(m)`` and of ``DataParallel(m).cuda()`` / ``.to(device)``: what the model
    binding holds once the wrapper is gone; the value itself otherwise."""
    bare = without_moves(value) if value is not None else None
    if isinstance(bare, cst.Call) and is_wrapper(resolve(dotted(bare.func), aliases)) and bare.args:
        return bare.args[0].value
    return value


def undo(work: _Work) -> None:
    """Every DataParallel / data_parallel call: deleted or replaced by what it wraps (the module docstring)."""
    for call in work.facts.calls:
        if is_wrapper(call.name):
            _wrapper(work, call)
        elif call.name in FUNCTIONS:
            _function(work, call)


def _wrapper(work: _Work, call: Call) -> None:
    args = call.node.args
    if not args or args[0].keyword is not None or args[0].star:
        work.leave(call.line, "DataParallel without its module as the first argument",
                   "delete the DataParallel wrap (prepare_model picks DataParallel or DDP from the launch), then "
                   "convert again", blocks=True)
        return
    module = args[0].value
    stmt = call.stmt
    assign = stmt.body[0] if stmt is not None and len(stmt.body) == 1 else None
    rebinding = isinstance(assign, cst.Assign) and len(assign.targets) == 1 and \
        dotted(assign.targets[0].target) == dotted(module) is not None and \
        inner(assign.value, work.facts.aliases) is module
    if rebinding:  # ``net = nn.DataParallel(net)``: the line goes (an ``if`` left empty goes with it)
        work.edits.remove.add(id(stmt))
        work.note(f"{dotted(module)} = DataParallel({dotted(module)}) deleted", "prepare_model wraps the model "
                  "once, from the launch: DataParallel for one process on several GPUs, DDP under ddpkit launch",
                  call.line)
    else:
        work.edits.expr[id(call.node)] = lambda node: node.args[0].value
        work.note("DataParallel(m) -> m", "prepare_model wraps the model once, from the launch (DataParallel or "
                  "DDP)", call.line)
    held = dotted(assign.targets[0].target) if isinstance(assign, cst.Assign) and len(assign.targets) == 1 else None
    if not any(r.startswith(f"{held or dotted(module)}.module") for r, _, _, _ in work.facts.reads):
        # (Knowledge-Distillation-Zoo's utils.load_pretrained_model keeps the keys its DataParallel model has)
        work.keep(call.line, "its state_dict keys lose DataParallel's 'module.' prefix: a checkpoint saved from it "
                  "now holds 'conv1.weight' where the original held 'module.conv1.weight'", "ddpkit's models load "
                  "either; a reader of your own that matches keys by name (into an nn.DataParallel, or strict=False) "
                  "would find none: strip or add 'module.' there")


def _function(work: _Work, call: Call) -> None:
    """``data_parallel(module, inputs, device_ids, output_device, dim, module_kwargs)`` -> ``module(inputs)``:
    the model around it is prepared, so each process runs its module on its own device."""
    args = call.node.args
    positional = [a for a in args if a.keyword is None and not a.star]
    keywords = {a.keyword.value: a for a in args if a.keyword is not None}
    module = positional[0].value if positional else keywords["module"].value if "module" in keywords else None
    inputs = positional[1].value if len(positional) > 1 else keywords["inputs"].value if "inputs" in keywords \
        else None
    extra = positional[5] if len(positional) > 5 else keywords.get("module_kwargs")
    if module is None or inputs is None or any(a.star for a in args):
        work.leave(call.line, "nn.parallel.data_parallel(...) whose module and inputs cannot be read",
                   "call the module itself, module(inputs) (prepare_model spreads the work), then convert again",
                   blocks=True)
        return
    code = cst.Module(body=[]).code_for_node

    def plain(node: cst.Call) -> cst.BaseExpression:
        new_args = [f"*{code(inputs)}" if isinstance(inputs, cst.Tuple) else code(inputs)]
        new_args += [f"**{code(extra.value)}"] if extra is not None else []
        return cst.parse_expression(f"{code(module)}({', '.join(new_args)})")

    work.edits.expr[id(call.node)] = plain
    work.note(f"data_parallel({code(module)}, ...) -> {code(module)}(...)", "the model around it is prepared: "
              "each process runs the module on its own device", call.line)


def modules(work: _Work) -> None:
    """``net.module`` of a model that was wrapped by hand -> ``ddpkit.unwrap(net)``: a model prepared in the
    single mode has no ``.module``, and in DDP this is the same module."""
    if not any(single_process(c.name) for c in work.facts.calls):
        return  # without a wrapper of its own, a script's ``.module`` is an attribute of its model
    wrapped = {b.target for b in work.models}
    for name, _scope, line, node in work.facts.reads:
        if isinstance(node, cst.Attribute) and node.attr.value == "module" and dotted(node.value) in wrapped:
            work.edits.expr[id(node)] = lambda n: cst.parse_expression(
                f"ddpkit.unwrap({cst.Module(body=[]).code_for_node(n.value)})")
            work.note(f"{name} -> ddpkit.unwrap({dotted(node.value)})", "the module inside the wrapper, in every "
                      "mode (a model prepared for one process has no .module)", line)
