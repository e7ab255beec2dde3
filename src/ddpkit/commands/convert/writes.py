"""Files every rank would write, made rank 0's by ``ddpkit convert``: figures (``plt.savefig``, ``fig.savefig``),
image grids (``torchvision.utils.save_image``), arrays (``np.save``), tables (``df.to_csv``) and text files opened
for writing (``with open(path, "w") as f:``). Every rank holds the same results, so N writers of one file race: a
CSV opened with ``"a"`` gets each row N times, a PNG may be cut off mid-write. ``torch.save`` is
:mod:`ddpkit.commands.convert.rules`'.

A write whose path names the rank, or lies under a temporary directory, is each rank's own and stays. So does a
``with`` block that does more than write (a collective, a backward, a loop over a DataLoader): guarding it would
keep the rest from the other ranks; it is left to you with its line.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import matplotlib.pyplot as plt\\nimport ddpkit\\nstate = ddpkit.init()\\nplt.savefig('loss.png')\\n")
    >>> p.text.splitlines()[-2:]
    ['if state.is_main:', "    plt.savefig('loss.png')"]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import RANK_WORDS
from ddpkit.commands.convert import batchnames, flow, paths
from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.handedin import iterated
from ddpkit.commands.convert.loaderuse import uncalled
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.readback import READS, read_back, writing
from ddpkit.commands.convert.readback import modes as open_modes
from ddpkit.commands.convert.rules import per_rank
from ddpkit.commands.convert.scan import Call
from ddpkit.commands.convert.waits import branched, main_test

_Work = Any  # the plan in the making (plan._Work)

WRITERS = {"matplotlib.pyplot.savefig": "the figure", "torchvision.utils.save_image": "the image",
           "matplotlib.pyplot.imsave": "the image", "matplotlib.image.imsave": "the image",  # (the UNet lessons')
           "numpy.save": "the array", "numpy.savetxt": "the array", "numpy.savez": "the arrays",
           "numpy.savez_compressed": "the arrays", "imageio.mimsave": "the animation", "imageio.imwrite": "the image",
           "imageio.imsave": "the image", "imageio.v2.mimsave": "the animation", "imageio.v2.imwrite": "the image",
           "imageio.v3.imwrite": "the image", "scipy.io.savemat": "the arrays", "soundfile.write": "the sound",
           "torchaudio.save": "the sound", "scipy.io.wavfile.write": "the sound",  # (melgan's save_sample)
           "librosa.output.write_wav": "the sound", "cv2.imwrite": "the image",
           "joblib.dump": "the object",  # (bert-entity-extraction's ``joblib.dump(meta, "meta.bin")``)
           "torch.onnx.export": "the exported model"}  # (LeNet-5 exports each epoch, then ``onnx.load``\ s it)
METHODS = {"savefig": "the figure", "to_csv": "the table", "to_json": "the table", "to_parquet": "the table",
           "to_excel": "the table"}  # a figure's, a pandas DataFrame's
OPENERS = ("open", "io.open", "builtins.open")
WHY = "every rank holds the same results, and N writers of one file race (an appended row N times, a file cut off)"


def writes(work: _Work) -> None:
    """Guard each file write of the script that every rank would make (see the module's docstring)."""
    opened = {id(c.node): c for c in work.facts.calls if (c.name in OPENERS or paths.path_open(work.facts, c)) and
              writing(c.node, c, work.facts)}
    backs = []  # (the writes every rank passes first: a barrier after one of them may serve one in a loop above)
    for call in work.facts.calls:
        what = WRITERS.get(call.name or "") or (METHODS.get(call.last) if isinstance(call.node.func, cst.Attribute)
                                                 and not (call.name or "").startswith(("torch.", "ddpkit.")) else None)
        what = what or _saved_object(work, call)
        if what is not None and call.name in WRITERS and not _ranked(call) and not _own(work, call) and \
                call.stmt is not None and any(isinstance(small, cst.Assign) and small.value is call.node
                                              for small in call.stmt.body):  # ``ok = cv2.imwrite(p, img)``
            work.leave(call.line, f"{call.last}(...) whose result is kept: every rank writes {what}", "call it on a "
                       "line of its own under `if ddpkit.init().is_main:` (the result is rank 0's then), then convert "
                       "again")
            continue
        if what is None or _ranked(call) or _own(work, call) or not _to_a_path(work, call):
            continue
        if call.scope.name.endswith(".__getitem__"):  # (set 29: a Dataset's picture of each sample it serves)
            work.keep(call.line, f"{call.last}(...) in {call.scope.name} left as it is: it writes {what} of each "
                      "sample the loader reads", "each rank reads its own samples and writes theirs (guarded, only "
                      "rank 0's would be written)")
            continue
        if call.stmt is None or len(call.stmt.body) != 1:
            work.leave(call.line, f"{call.last}(...) inside a larger statement: every rank writes {what}",
                       "put it on a line of its own under `if ddpkit.init().is_main:`")
            continue
        if id(call.stmt) not in work.edits.guard:
            work.edits.guard[id(call.stmt)] = main_test(work, call.scope, call.line)
            stepped = _of_the_step(work, call)
            work.note(f"{call.last} guarded: rank 0 writes {what}", WHY if stepped is None else "N writers of one "
                      "file race; what it shows is rank 0's share of the step's batch", call.line)
            last = _last_batch(work, call) if stepped is None else None
            if last:  # (a VAE lesson's reconstruction of the epoch's last batch, saved after the loop)
                work.keep(call.line, f"{call.last}(...) writes {what} of {last}, the training loop's last batch",
                          "at N processes that batch is rank 0's part of the global one (B/N samples); "
                          f"ddpkit.gather({last}) before the guarded write shows the whole batch")
            if stepped:  # (pytorch-UNet's ``save_image(img, f'{save_path}/{i}.png')`` each step)
                work.leave(call.line, f"{call.last}(...) writes {what} of each training step's batch under the step's "
                           f"number ({stepped}): at N processes it shows rank 0's share of the batch (with a batch "
                           "kept per process, rank 0's steps: 1/N of the files)", "gather the batch's pictures before "
                           "the guarded write (ddpkit.gather(...)), or keep rank 0's if a sample of them is enough")
            backs.append((call, call.stmt))
    for call, stmt in sorted(backs, key=lambda back: branched(work, back[0])):
        read_back(work, call, stmt, WRITERS.get(call.name or ""))
    _shown_batches(work)
    blocks = _with_blocks(work.facts.module)
    within = {id(i.item) for block in blocks for i in block.items}  # (``with open(...) as f``: guarded below)
    kept = {id(b.value) for b in work.facts.bindings if b.value is not None} - within
    for call in opened.values():  # ``log = open("log.txt", "w")``, then ``log.write(...)`` every epoch
        if id(call.node) in kept and not _ranked(call) and not _own(work, call) and call.name not in OPENERS:
            work.leave(call.line, "a file opened for writing with pathlib's path.open(...) and kept: every rank "
                       "writes it", "open it with open(path, mode) (the others then write to os.devnull), or write "
                       "it under `if ddpkit.init().is_main:`")  # (its first argument is the mode: review 42)
        elif id(call.node) in kept and not _ranked(call) and not _own(work, call):
            _to_null(work, call)
    for block in blocks:
        calls = [opened[id(i.item)] for i in block.items if id(i.item) in opened]
        if not calls or any(_ranked(c) or _own(work, c) for c in calls):
            continue
        call = calls[0]
        if not _only_writes(work, block, call.line):
            work.leave(call.line, "a file opened for writing in a block that does more than write: every rank "
                       "writes it", "move the writing into a block of its own under `if ddpkit.init().is_main:`")
            continue
        work.edits.guard[id(block)] = main_test(work, call.scope, call.line)
        _read_by_rank_zero(work, block)
        for save in [c for c in work.facts.calls if c.stmt is not None and _saved_into(c, block)]:
            work.edits.guard.pop(id(save.stmt), None)  # (guarded with its block: one test, not two)
            waits = work.edits.after.pop(id(save.stmt), [])  # its barrier: after the block, where every rank is
            work.edits.after.setdefault(id(block), []).extend(w for w in waits if w not in
                                                               work.edits.after.get(id(block), []))
        work.note("open(..., 'w') guarded: rank 0 writes the file", WHY, call.line)
        if "ddpkit.barrier()" not in work.edits.after.get(id(block), []):
            read_back(work, call, block)


def _shown_batches(work: _Work) -> None:
    """A picture of the training step's batch handed to TensorBoard each step (a UNet lesson's
    ``writer_train.add_image('input', input, step, dataformats='NHWC')``): the writer is rank 0's, and what it shows
    is rank 0's share of the batch; said once a loop."""
    said: set[int] = set()
    for call in work.facts.calls:
        loop = call.loops[-1] if call.loops and flow.trains(work.facts, call.loops[-1]) else None
        if call.last not in TB_PICTURES or not isinstance(call.node.func, cst.Attribute) or loop is None or \
                id(loop) in said or isinstance(loop.node, cst.For) and isinstance(loop.node.iter, cst.Call) and \
                dotted(loop.node.iter.func) == "range":  # (an epoch loop: its pictures are no step's)
            continue
        # the picture (not the tag, nor the step's number): the batch, or what the step makes of it
        picture = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value in
                        ("img_tensor", "figure", "vid_tensor")), None) or \
            next((a.value for i, a in enumerate(call.node.args) if i == 1 and a.keyword is None), None)
        made = set(loop.targets)
        for b in sorted((b for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= call.line
                         and _value(b) is not None), key=lambda b: b.line):
            if names_in(_value(b)) & made:
                made.add(b.target)
        if picture is not None and names_in(picture) & made:
            said.add(id(loop))
            work.keep(call.line, f"{call.last}(...) shows the training step's batch each step", "rank 0's writer, "
                      "and rank 0's share of the batch at N processes (1/N of its samples): ddpkit.gather(...) "
                      "the pictures first to show the whole batch")


def _value(binding: Any) -> Any:
    """What a binding was made from: its value, or the whole call a tuple is unpacked from (``code, recon =
    model(img)``: each name is the step's)."""
    return binding.value if binding.value is not None else binding.whole


TB_PICTURES = ("add_image", "add_images", "add_figure", "add_video", "add_mesh")


def _of_the_step(work: _Work, call: Call) -> str | None:
    """The loop variable a write in a training loop names its file by (``i`` of ``for i, (x, y) in
    enumerate(loader)``), where what it writes reads the loop's batch or what the loop makes of it ("": no such
    name); None where it writes nothing of the step's."""
    loop = next((lp for lp in reversed(call.loops) if flow.trains(work.facts, lp)), None)
    if loop is None or not call.node.args:
        return None
    made = _batch_targets(loop)  # the batch, and what the step makes of it (not ``fake = G(fixed_noise)``)
    for b in sorted((b for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end
                     and _value(b) is not None), key=lambda b: b.line):
        if names_in(_value(b)) & made:
            made.add(b.target)
    values = [a.value for a in call.node.args]
    written = set().union(*(names_in(v) for v in values))
    named = set().union(*(names_in(v) for v in values[1:] if isinstance(v, (cst.FormattedString, cst.BinaryOperation,
                                                                            cst.Call, cst.ConcatenatedString))))
    counter = sorted(named & loop.targets)
    # (a name bound again before the write to what no batch makes, ``g_out = G(fixed_noise)``: extra five of set 28)
    written = {n for n in written if (b := flow.binding_of(work.facts, n, call.scope, call.line)) is None or
               _value(b) is None or names_in(_value(b)) & made or n in loop.targets}
    if not written & made - set(counter):
        return None
    return counter[0] if counter else ""


def _branched(call: Call, binding: Any) -> bool:
    """``binding`` is made under an ``if`` that does not hold ``call`` too (``if use_fixed: fake = G(fixed)``)."""
    for branch in m.findall(call.scope.node, m.If()):
        holds = any(s is binding.stmt for s in m.findall(branch, m.SimpleStatementLine()))
        if holds and not any(c is call.node for c in m.findall(branch, m.Call())):
            return True
    return False


def _batch_targets(loop: Any) -> set[str]:
    """The names a loop binds to its batch: none for a count (``for epoch in range(n)``: a GAN's picture of
    ``netG(fixed_noise)`` saved as ``f"gan-{epoch}.png"`` was said "rank 0's share of the step's batch", set 26),
    not the index of ``enumerate``."""
    if loop.over_count():
        return set()
    it = loop.node.iter if isinstance(loop.node, cst.For) else None
    target = loop.node.target if isinstance(loop.node, cst.For) else None
    if isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and isinstance(target, cst.Tuple) and \
            target.elements and isinstance(target.elements[0].value, cst.Name):
        return set(loop.targets) - {target.elements[0].value.value}
    return set(loop.targets)


def _last_batch(work: _Work, call: Call) -> str | None:
    """The training loop's batch (a loop target, as it stands after the loop) that what ``call`` writes is made of,
    the call below that loop in its function: the last batch's picture; None where it writes none."""
    facts = work.facts
    for loop in (lp for lp in facts.loops if lp.scope is call.scope and lp.end < call.line and
                 flow.trains(facts, lp) and all(any(o is c for c in call.loops) for o in lp.outer)):
        made = set(batchnames.batch_names(facts, loop))
        again = {b.target for b in facts.bindings if b.scope is call.scope and loop.end < b.line < call.line and
                 b.target in made and not names_in(_value(b) or cst.Name("_")) & made}
        made -= again  # (bound anew after the loop: no longer the batch)
        for b in sorted((b for b in facts.bindings if b.scope is call.scope and loop.line < b.line < call.line and
                         _value(b) is not None), key=lambda b: b.line):
            if names_in(_value(b)) & made:
                made.add(b.target)
            elif b.line > loop.end and not _branched(call, b):  # (``fake = G(fixed_z)`` after the loop: no longer
                made.discard(b.target)  # what the step made; under an ``if`` of its own, maybe still: review 41)
        first = call.node.args[0].value if call.node.args else None
        read = sorted(names_in(first) & made) if first is not None else []
        if read:
            return read[0]
    return None


def _to_a_path(work: _Work, call: Call) -> bool:
    """The write is a statement of its own (``report = df.to_json()`` returns the text: guarded, the other ranks
    would lack ``report``) and goes to a file: a path is given, and it is no in-memory buffer (``io.BytesIO``)."""
    stmt = call.stmt  # (one of the statements of a ``;``-joined line too: said there, ``fig.savefig(p); plt.close()``)
    if stmt is None or not any(isinstance(small, cst.Expr) and small.value is call.node for small in stmt.body):
        return False
    target = next((a.value for a in call.node.args if a.keyword is None or a.keyword.value in
                   ("fname", "fp", "file", "path", "path_or_buf")), None)
    if target is None:
        return False
    place = {"torchvision.utils.save_image": 1, "joblib.dump": 1, "torch.onnx.export": 2}.get(call.name or "")
    if place is not None:  # save_image(tensor, fp): the path comes second; onnx.export(model, args, f): third
        positional = [a.value for a in call.node.args if a.keyword is None]
        target = positional[place] if len(positional) > place else next(
            (a.value for a in call.node.args if a.keyword is not None and a.keyword.value in ("fp", "filename", "f")),
            None)
    bound = [b.value for b in work.facts.bindings if b.target == dotted(target)] if dotted(target) else []
    memory = ("BytesIO", "StringIO")
    return target is not None and not any(
        isinstance(v, cst.Call) and (resolve(dotted(v.func), work.facts.aliases) or "").endswith(memory) for v in bound)


def _to_null(work: _Work, call: Call) -> None:
    """A file opened for writing and kept open (RAdam's ``Logger``: ``self.file = open(fpath, 'w')`` in
    ``__init__``, written by its methods): the other ranks open ``os.devnull`` instead, so every write through
    the name stays as it is and one copy lands (a mode that also reads, ``w+``, is left to the user)."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    modes = open_modes(call.node, call, work.facts)
    shadowed = any(b.target == "os" for b in work.facts.bindings) or \
        any("os" in scope.params for scope in work.facts.scopes.values())  # (a parameter named ``os``)
    # (a file written, then read back by the script: a barrier's business; not a read of another path, SparseTSF's
    # ``result.txt`` above a ``np.load`` of its own outputs)
    # (review 26: a reader in a function defined above may run after, ``np.genfromtxt`` reads too)
    # (not from a helper of a project module that nothing calls: utils.py's ``write_json`` beside its ``read_json``,
    # set 29; its writes go to one copy all the same)
    read = not uncalled(work, call) and any((c.line > call.line or c.scope is not call.scope and c.scope.name) and
               (c.name in OPENERS and not writing(c.node) or c.last in READS or c.last == "genfromtxt") and
               paths.maybe_same(work.facts, call, paths.first_path(call), c, paths.first_path(c))
               for c in work.facts.calls)
    if not positional or not modes or set("".join(modes)) & {"+", "x"} or shadowed or read:
        work.leave(call.line, "a file opened for writing and kept open (written later through its name): every "
                   "rank writes it", "open it on rank 0 only (`if ddpkit.init().is_main:`, and guard its "
                   "writes), or "
                   "give the other ranks open(os.devnull, 'w')")
        return
    test = main_test(work, call.scope, call.line)
    if work.facts.aliases.get("os") != "os" and "import os" not in work.edits.imports:
        work.edits.imports.append("import os")
    work.edits.expr[id(positional[0].value)] = lambda node: cst.IfExp(
        test=cst.parse_expression(test), body=node, orelse=cst.parse_expression("os.devnull"))
    work.note("open(..., 'w') kept open: rank 0 writes the file, the other ranks os.devnull", WHY, call.line)


def _ranked(call: Call) -> bool:
    return any(w in test.lower() for test in call.tests for w in RANK_WORDS)


def _own(work: _Work, call: Call) -> bool:
    """Each rank's own file (:func:`~ddpkit.commands.convert.rules.per_rank` of the call's arguments)."""
    return per_rank(work, [a.value for a in call.node.args])


# what makes an object whose ``.save(path)`` writes a file: a PIL image (Diffusion-Models-pytorch's
# ``Image.fromarray(ndarr).save(path)``), a matplotlib animation (InfoGAN's ``anim.save('gan.gif')``)
SAVED = {"PIL.Image.fromarray": "the image", "PIL.Image.open": "the image", "PIL.Image.new": "the image",
         "torchvision.transforms.functional.to_pil_image": "the image",
         "torchvision.transforms.ToPILImage": "the image",  # (made and called: ``ToPILImage()(img.cpu())``)
         "matplotlib.animation.": "the animation"}


def _saved_object(work: _Work, call: Call) -> str | None:
    """``X.save(path)`` of an object made by one of :data:`SAVED`, in the call itself or bound to X's name."""
    func = call.node.func
    if call.last != "save" or not isinstance(func, cst.Attribute):
        return None
    made: cst.BaseExpression | None = func.value
    if not isinstance(made, cst.Call) and made is not None:
        name = dotted(made)
        bound = binding_of(work.facts, name, call.scope, call.line) if name else None
        made = bound.value if bound is not None else None
    if isinstance(made, cst.Call) and isinstance(made.func, cst.Call):  # ``transforms.ToPILImage()(img)``
        made = made.func
    maker = resolve(dotted(made.func), work.facts.aliases) if isinstance(made, cst.Call) else None
    if call.loops and not (maker or "").startswith("matplotlib.animation.") and not _after_training(work, call):
        return None  # (an image in a loop: a preparation writing a folder the ranks then read, each its own copy)
    return next((what for key, what in SAVED.items() if maker and (maker == key or key.endswith(".") and
                                                                   maker.startswith(key))), None)


def _after_training(work: _Work, call: Call) -> bool:
    """``call`` is in a function called below a training loop (a GAN's ``save_image_grid(fake, ...)`` after the
    epochs, saving each generated image in a loop): the samples of the trained model, not a preparation."""
    sites = flow.callers(work.facts, call.scope) if call.scope.name else []
    return any(lp.scope is site.scope and lp.end < site.line and flow.trains(work.facts, lp)
               for site in sites for lp in work.facts.loops)


def _read_by_rank_zero(work: _Work, block: cst.With) -> None:
    """A load inside a block made rank 0's (``model.load_state_dict(torch.load(best))`` in the block writing its
    report, set 28): rank 0 alone reads it, after its own save, so the barrier line said for it is dropped (where
    the block stays every rank's, listed, the line stays: review 44)."""
    inside = {c.line for c in work.facts.calls if c.name == "torch.load" and
              any(n is c.node for n in m.findall(block, m.Call()))}
    work.left[:] = [x for x in work.left if not any(x.what.startswith(f"a file is read at line {line} ")
                                                    for line in inside)]


def _with_blocks(module: cst.Module) -> list[cst.With]:
    return [node for node in m.findall(module, m.With()) if isinstance(node, cst.With)]


def _only_writes(work: _Work, block: cst.With, start: int) -> bool:
    """No ``break`` / ``continue`` / ``return`` / ``yield`` (rank 0 alone would leave); no collective, save, backward
    or optimizer step inside, nor a call of the script's function that trains; no loop over anything but results
    the script holds (a list it built, a range: not a loader, nor a function's parameter, which may be a sharded
    one: rank 0 would write only its shard); no name bound inside that is read below the block (on the other ranks
    it would not exist). ``print(..., file=f)`` is writing: on the other ranks the open alone empties what rank 0
    wrote."""
    inside: set[int] = set()

    class Nodes(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            inside.add(id(node))
            return True

    block.body.visit(Nodes())
    if m.findall(block.body, m.Break() | m.Continue() | m.Return() | m.Yield()):  # rank 0 alone would leave
        return False
    calls = [c for c in work.facts.calls if id(c.node) in inside and not _saved_into(c, block)]
    if any((c.name or "").startswith(("ddpkit.", "torch.distributed", "torch.save")) or c.last in
           ("barrier", "all_reduce", "reduce", "all_gather", "broadcast", "backward", "step") for c in calls):
        return False
    if any((t := flow.callee(work.facts, c)) is not None and flow.scope_trains(work.facts, t[0]) for c in calls):
        return False  # ``f.write(f"{fit(model, x, y):.4f}")``: the training itself, rank 0's alone (a hang)
    for loop in work.facts.loops:
        if id(loop.node) in inside and not all(_held(work, name, loop) for name in _iterated(loop)):
            return False
    bound = {b.target for b in work.facts.bindings if b.stmt is not None and id(b.stmt) in inside}
    # (not one bound again before it is read: a CSV log's ``writer = csv.writer(f)`` in each of its blocks)
    again = [b for b in work.facts.bindings if b.target in bound and b.line > start and
             (b.stmt is None or id(b.stmt) not in inside)]
    return not any(name in bound and id(node) not in inside and line > start and
                   not any(b.target == name and b.scope is scope and b.line <= line for b in again)
                   for name, scope, line, node in work.facts.reads)


def _saved_into(call: Call, block: cst.With) -> bool:
    """``torch.save(obj, f)`` into the file the ``with`` opened (``with open(p, 'wb') as f:``): writing it."""
    names = {dotted(i.asname.name) for i in block.items if i.asname is not None}
    args = [a for a in call.node.args if a.keyword is None or a.keyword.value == "f"]
    return call.name == "torch.save" and len(args) > 1 and dotted(args[1].value) in names


def _iterated(loop: Any) -> set[str]:
    return iterated(loop.node.iter) if isinstance(loop.node, cst.For) else {"<while>"}


def _held(work: _Work, name: str, loop: Any) -> bool:
    """A name the loop reads results from that the script built itself: a list, a tuple, a dict, a range, a
    comprehension (a parameter, a loader, or a call's result may be a sharded loader)."""
    if name == "<while>":
        return True
    return _built_here(work, name, loop.scope, loop.line)


# a copy of what it is handed, in another container (``losses = np.array(losses)`` of a list the loop filled)
COPIES = ("numpy.array", "numpy.asarray", "torch.tensor", "list", "tuple", "sorted", "reversed", "enumerate", "zip")


def _built_here(work: _Work, name: str, scope: Any, line: int, depth: int = 0) -> bool:
    binding = binding_of(work.facts, name, scope, line)
    value = binding.value if binding is not None else None
    if isinstance(value, (cst.List, cst.Tuple, cst.Dict, cst.ListComp, cst.DictComp, cst.Set, cst.SimpleString)):
        return True
    copied = isinstance(value, cst.Call) and resolve(dotted(value.func), work.facts.aliases) in COPIES and \
        bool(value.args) and depth < 3
    held = [dotted(a.value) for a in value.args] if copied else []  # type: ignore[union-attr]
    return copied and all(h is not None and h != name and _built_here(work, h, scope, line, depth + 1) or
                          h == name and binding is not None and _built_here(work, h, scope, binding.line - 1, depth + 1)
                          for h in held)
