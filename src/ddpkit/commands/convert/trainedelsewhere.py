"""Where a script's training is when it is not in the script: a module of its folder (minGPT's Trainer), a module
that builds its own optimizer, or a package of the project outside the folder (swa_gaussian's ``swag``, whose
``utils.train_epoch`` and ``data.loaders`` the script calls). Converting the script alone, or with the modules
beside it, distributes nothing there: said, with the command that converts them together."""

from __future__ import annotations

import ast
import os

from ddpkit.commands.convert import project, unread

MODULE_BYTES = 4 << 20  # a module of the folder read for its optimizers: larger is no training code of the script's
TRAINS = {"run", "fit", "train_model", "run_training", "train_loop", "training_loop"}  # or a train(...) of a module


def outside(script: str, entry, results: list) -> list[str]:
    """The line for a project (or one script) none of whose files takes a backward or converts a loader, whose entry
    hands its model to a training function it imports (``utils.train_epoch(loaders["train"], model, ...)``): that
    function and its loader are outside what was read, and every rank would train on every batch."""
    if entry.refused or any("data_loader(" in r.text or ".backward(" in r.source for r in results):
        return []
    calls = [node for node in ast.walk(ast.parse(entry.source)) if isinstance(node, ast.Call)]
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
              for node in calls}
    if not any("prepare_model(" in r.text for r in results) and "DataLoader" not in called:
        return _unread_package(script, calls, entry.source)
    if "prepare_model(" not in entry.text or "DataLoader" in called or \
            not any(name in TRAINS or "Trainer" in name or name.startswith("train") for name in called):
        return []
    return [f"  {script}: left to you: no DataLoader converted and no backward in what was read: the training loop "
            "and its loader are elsewhere (a package of the project outside the script's folder?) and stay as they "
            "are: every rank would train on every batch; convert them with it: ddpkit convert FOLDER (the project's)"]


def _unread_package(script: str, calls: list[ast.Call], source: str) -> list[str]:
    """The line for a project none of whose files converts anything, whose entry calls a training function it
    imports from a module the project's files do not hold (a ``src/`` layout: ``from resnet_cifar10.train import
    train``, the package in ``src/resnet_cifar10/``): named, with the file to convert where it is found."""
    called = {node.func.id for node in calls if isinstance(node.func, ast.Name)}
    for node in ast.walk(ast.parse(source)):
        names = [a.asname or a.name for a in node.names] if isinstance(node, ast.ImportFrom) and node.module and \
            not node.level else []
        handed = next((n for n in names if n in called and (n in TRAINS or n.startswith("train") or "Trainer" in n)),
                      None)
        if handed is None:
            continue
        assert isinstance(node, ast.ImportFrom) and node.module
        parts = node.module.split(".")
        here = os.path.join(os.path.dirname(os.path.abspath(script)), *parts)
        if os.path.isfile(here + ".py") or os.path.isdir(here):
            return []  # (a module of the script's folder: read, and it trains nothing convert can see)
        found = _module_path(script, node.module)
        if found is None:  # (an installed library's: Lightning's Trainer, transformers' Trainer)
            continue
        return [f"  {script}: left to you: nothing was converted: {handed}() comes from {node.module}, which is not "
                "among the files read (a src/ layout?), so its training loop and loader stay as they are and every "
                f"rank would train on every batch; convert the module that trains: ddpkit convert --imports {found}"]
    return []


def _module_path(script: str, module: str) -> str | None:
    """The file of ``module`` in a folder above the script's or in its ``src/`` (three levels up at most), as a path
    from the working directory; None when not found."""
    folder = os.path.dirname(os.path.abspath(script))
    for _ in range(4):
        for base in (folder, os.path.join(folder, "src")):
            path = os.path.join(base, *module.split(".")) + ".py"
            if os.path.isfile(path):
                return os.path.relpath(path)
        folder = os.path.dirname(folder)
    return None


def lines(script: str, result) -> list[str]:
    """The line for a script that prepares no model and converts no loader, but imports modules of its folder:
    its training loop is likely there (minGPT's Trainer), and converting the script alone distributes nothing."""
    if result.refused:
        return []
    modules = project.files_of(script, imports=True)[1][1:]
    calls = [node for node in ast.walk(ast.parse(result.source)) if isinstance(node, ast.Call)]
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
              for node in calls}
    if "prepare_model(" in result.text or "data_loader(" in result.text:
        return _optimizers(script, modules, trains="prepare_model(" in result.text) or \
            [f"  {script}: left to you: {said}; convert them together: ddpkit convert --imports {script}"
             for said in unread.writers(script, modules, result.source)[:3]] or outside(script, result, [result])
    if modules:
        return [f"  {script}: left to you: no model is prepared and no DataLoader converted here, and the script "
                f"imports {', '.join(modules[:3])}{' ...' if len(modules) > 3 else ''} from its folder (its training "
                f"loop?): convert them together: ddpkit convert --imports {script}"]
    # what hands the training to another module: train(epoch), trainer.run(), Trainer(...), model.fit(...)
    hands = any(name in TRAINS or "Trainer" in name for name in called) or any(
        node.args and (isinstance(node.func, ast.Name) and node.func.id == "train" or
                       isinstance(node.func, ast.Attribute) and node.func.attr == "train") for node in calls)
    if called & {"backward", "step", "DataLoader"} or not hands:
        return []
    return [f"  {script}: left to you: no training loop here (no backward, optimizer step or DataLoader), so nothing "
            "is distributed: if a module it imports trains (a Trainer's run()), convert that module with it: ddpkit "
            f"convert --imports {script}, or ddpkit convert FOLDER for a package outside the script's folder"]


def _optimizers(script: str, modules: list[str], trains: bool) -> list[str]:
    """The line for a script converted alone while a module of its folder builds an optimizer of its own and takes a
    backward (a layer that trains itself inside ``forward``, a Trainer that makes its optimizer): the model that one
    trains is out of this file's reach, and each rank would train its own copy. Where the script prepares no model,
    also a module that only builds its optimizer (``optimizer = set_optimizer(opt, model)``); where it prepares one,
    such a module trains nothing itself (nanoGPT's ``configure_optimizers``)."""
    from ddpkit.commands.check.rules import OPTIMIZERS

    root = os.path.dirname(os.path.abspath(script))
    for rel in modules:
        path = os.path.join(root, rel)
        try:
            if os.path.getsize(path) > MODULE_BYTES:
                continue
            with open(path, "rb") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # (converting it together says what is wrong with it)
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
        names = [(node, node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
                 for node in calls]
        if trains and not any(name == "backward" for _, name in names):
            continue  # it builds the script's optimizer (nanoGPT's configure_optimizers), whose model is prepared
        for node, name in names:
            if name in OPTIMIZERS:
                return [f"  {script}: left to you: {rel}:{node.lineno} (imported from the script's folder) builds "
                        f"an optimizer ({name}): converted alone, this file cannot prepare the "
                        "model it trains, and each rank would train its own copy; convert them together: ddpkit "
                        f"convert --imports {script}"]
    return []


