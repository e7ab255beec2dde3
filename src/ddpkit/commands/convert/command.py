"""``ddpkit convert script.py``: rewrite a single-device training script into a ddpkit one, and prove it.

Prints a unified diff and, for each edit, its line and why; ``--write`` rewrites the file in place, ``-o OUT``
writes the result elsewhere. What it cannot convert safely it leaves unchanged and lists (line, what to do);
when what is left would make the result train differently (a loader it cannot tell training from
evaluation, batches fed by hand, a script already distributed by hand) it writes nothing and says
``refused``. ``--verify`` then runs ``ddpkit verify`` on the result (1 process against N) and
``ddpkit check`` (the usual DDP mistakes); arguments after the script go to the script.

Exit: 0 converted (or nothing to change), 1 refused or something left to you, 2 bad input; with
``--verify``, verify's code when it does not pass (4 the weights differ, 5 cannot compare). Needs libcst
(``pip install 'ddpkit[convert]'``): a concrete syntax tree keeps the script's comments and formatting.

Example::

    $ ddpkit convert train.py                   # the diff and the list of edits
    $ ddpkit convert --write train.py           # in place
    $ ddpkit convert -o train_ddp.py --verify train.py --epochs 1
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import io
import json
import os
import subprocess
import sys
import tempfile
import tokenize
from collections.abc import Sequence
from typing import Any

from ddpkit.commands import itself
from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.commands.convert import crossing, project, tabs, trainedelsewhere
from ddpkit.core.atomic import write_atomically
from ddpkit.core.errors import SCRIPT_FAILED, UsageError

PROG = "ddpkit convert"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Rewrite a single-device training script into a ddpkit script.")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--write", action="store_true", help="rewrite the script in place")
    out.add_argument("-o", "--output", default=None, help="write the converted script to this path")
    p.add_argument("--verify", action="store_true", help="then run ddpkit verify and ddpkit check on the result")
    p.add_argument("--nproc-per-node", type=int, default=2, help="processes for --verify (default 2)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps --verify compares (default 5)")
    p.add_argument("--per-process-batch", action="store_true", help="keep a training loader's batch_size per "
                   "process (the global batch grows with the processes); default: it is the global batch")
    p.add_argument("--json", action="store_true", help="one JSON object: edits, left, refused, diff")
    p.add_argument("--imports", action="store_true", help="also convert the modules of the script's folder that it "
                   "imports (a trainer in another file); with several files, -o names a directory")
    p.add_argument("script", help="the training script, or a folder: every .py file under it")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (--verify)")
    return p


def convert_file(path: str, per_process_batch: bool = False, crossing=None):
    """The :class:`~ddpkit.commands.convert.plan.Plan` for the script at ``path`` and the file's encoding
    (UsageError: not readable as Python, or libcst missing). The bytes are decoded as Python reads them
    (PEP 263, a BOM) and line endings are kept (CRLF stays CRLF)."""
    try:
        from libcst import ParserSyntaxError, parse_module

        from ddpkit.commands.convert.plan import plan
    except ImportError as exc:
        raise UsageError(f"convert needs libcst ({exc}); install it with pip install 'ddpkit[convert]'") from None
    try:
        with open(path, "rb") as f:
            raw = f.read()
        encoding = tokenize.detect_encoding(io.BytesIO(raw).readline)[0]
        source = raw.decode(encoding)
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise UsageError(f"cannot read {path!r} as a Python script ({exc.__class__.__name__}: {exc}); "
                         "expected a .py file in UTF-8 or the encoding its coding line names") from None
    try:
        # the interpreter's own parser first: it refuses in one line what would crash libcst's native parser
        # (a crafted file of 3000 nested parentheses overflows its stack: a segfault, not an exception)
        ast.parse(source, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        detail = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, SyntaxError) and exc.lineno else \
            (exc.msg if isinstance(exc, SyntaxError) else f"{type(exc).__name__}: {exc}")
        raise UsageError(f"{path} is not Python 3 this tool can parse ({detail}); fix the syntax, then convert "
                         "again") from None
    unparsed = f"{path} is Python, but not Python libcst can parse (line {{}}: {{}}); convert it by hand " \
        "(docs/convert.md lists the edits)"
    # (the file parsed first, apart: a parse error inside the plan is the converter's, not the script's)
    expanded, deep = None, f"{path} nests too deeply to convert; expected a training script"
    try:
        try:
            parse_module(source)
        except ParserSyntaxError as exc:
            expanded = tabs.expanded(source)  # (improved-wgan's ``12 spaces + TAB + 4 spaces``: Python's tab stops)
            if expanded is None:
                raise UsageError(unparsed.format(exc.raw_line, exc.message)) from None
            parse_module(expanded)
    except ParserSyntaxError as exc:
        raise UsageError(unparsed.format(exc.raw_line, exc.message)) from None
    except RecursionError:
        raise UsageError(deep) from None
    try:
        result = plan(source if expanded is None else expanded, per_process_batch, crossing)
    except RecursionError:
        raise UsageError(deep) from None
    if expanded is None:
        return result, encoding
    from ddpkit.commands.convert.plan import Edit

    result.edits.insert(0, Edit(1, "tabs in the indentation expanded to spaces", "the file mixes tabs and spaces "
                                "in a way Python reads (a tab to the next multiple of 8) and libcst does not; the "
                                "code is the same (its syntax trees compared)"))
    # (the diff and what is written are against the file as it is: review 23's ``--json`` diff did not apply)
    return dataclasses.replace(result, source=source, text=source if result.refused else result.text), encoding


def report(result, path: str) -> list[str]:
    """The lines that say what was done and what is left, for people (stderr)."""
    lines = [f"  {path}:{e.line}: {e.what}: {e.why}" for e in result.edits]
    head = f"{PROG}: {len(result.edits)} edit(s) in {path}" if result.edits else f"{PROG}: nothing to change in {path}"
    if result.refused:
        head = f"{PROG}: refused: nothing written for {path}: converting it safely needs what is listed below"
        lines = []
    lines += [f"  {path}:{x.line}: {'refused' if x.blocks else 'left to you'}: {x.what}; {x.fix}"
              for x in result.left]
    lines += [f"  {path}:{k.line}: kept: {k.what}: {k.why}" for k in result.kept if not result.refused]
    return [head, *lines]


def _diff(result, path: str) -> str:
    """git's headers (``a/train.py``, ``b/train.py``) for a relative path; an absolute one as it is; a last line
    without a newline marked as git marks it."""
    old, new = (path, path) if os.path.isabs(path) else (f"a/{path}", f"b/{path}")
    lines = difflib.unified_diff(result.source.splitlines(True), result.text.splitlines(True), old, new)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def verify_and_check(converted: str, script_args: list[str], nproc: int, steps: int) -> tuple[int, list[str]]:
    """``ddpkit verify`` on the converted script (a subprocess: it launches processes), then ``ddpkit check``."""
    from ddpkit.commands.check.command import analyze

    cmd = itself.command("verify", "--nproc-per-node", str(nproc), "--steps", str(steps), converted, *script_args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    # the verdict, its cause, and which test decided it (a float64 or a matched-draws re-run)
    said = [line.strip() for line in done.stdout.splitlines()
            if line.startswith(("PASS", "FAIL", "likely cause", "  decided by", "  the float64 re-run"))]
    last = ([line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"])[-1]
    lines = [f"{PROG}: verify: {line}" for line in said] or [f"{PROG}: verify: exit {done.returncode}: {last}"]
    with open(converted, encoding="utf-8") as f:
        found = analyze(f.read())
    lines += [f"{PROG}: check: {'nothing found' if not found else f'{len(found)} finding(s)'}"]
    lines += [f"  {converted}:{x.line}: {x.rule} {x.severity}: {x.message}" for x in found]
    code = done.returncode or (SCRIPT_FAILED if found else 0)
    return code, lines


def _arguments(ns: argparse.Namespace) -> None:
    if not os.path.isfile(ns.script) and not os.path.isdir(ns.script):
        raise UsageError(f"{ns.script!r}: no such file; expected the path of a .py training script or a folder")
    if os.path.isdir(ns.script) and ns.verify:
        raise UsageError(f"--verify runs one script, and {ns.script} is a folder; name the script with --imports "
                         f"(ddpkit convert --imports {ns.script.rstrip(os.sep)}/train.py -o OUT --verify)")
    if (os.path.isdir(ns.script) or ns.imports) and ns.output and os.path.isfile(ns.output):
        raise UsageError(f"-o {ns.output} is a file, and several files are written; name a directory")
    if ns.imports and ns.verify and not (ns.output or ns.write):
        raise UsageError("--verify of several files runs them where they are written; add -o DIR or --write")
    if ns.script.endswith(".ipynb"):
        raise UsageError(f"{ns.script} is a notebook; convert its code to a script first (jupyter nbconvert "
                         "--to script), then convert that")
    if ns.script_args and not ns.verify:
        raise UsageError(f"arguments after the script ({' '.join(ns.script_args)}) go to it under --verify "
                         "only; add --verify or drop them")
    if ns.verify and (ns.nproc_per_node < 2 or ns.steps < 1):
        raise UsageError(f"--verify compares >= 2 processes over >= 1 step; got --nproc-per-node "
                         f"{ns.nproc_per_node} --steps {ns.steps}")


def _parsed(argv: list[str]) -> argparse.Namespace:
    """The options, also when typed after the script (``ddpkit convert train.py -o out.py``, the order people
    type): without --verify nothing after the script is the script's, so it is read as convert's own; what convert
    does not know keeps the one-line error that it goes to the script under --verify only.

    >>> vars(_parsed(["train.py", "-o", "out.py"]))["output"], _parsed(["train.py", "--lr", "1"]).script_args
    ('out.py', ['--lr', '1'])
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not ns.script_args or ns.verify:
        return ns
    at = len(argv) - len(ns.script_args) - 1  # the script's place: REMAINDER is what follows it
    try:
        again = parser.parse_args([*argv[:at], *ns.script_args, argv[at]])
    except UsageError:
        return ns
    return again


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = _parsed(list(sys.argv[1:] if argv is None else argv))
        _arguments(ns)
        if os.path.isdir(ns.script) or ns.imports:
            return _main_many(ns)
        result, encoding = convert_file(ns.script, ns.per_process_batch)
    except UsageError as exc:
        return usage_error(PROG, exc)
    if ns.json:
        print(json.dumps({"script": ns.script, "refused": result.refused, "changed": result.text != result.source,
                          "edits": [vars(e) for e in result.edits], "left": [vars(x) for x in result.left],
                          "kept": [vars(k) for k in result.kept],
                          "diff": _diff(result, ns.script)}))
    else:
        sys.stdout.write(_diff(result, ns.script))
    elsewhere = trainedelsewhere.lines(ns.script, result)
    for line in report(result, ns.script) + elsewhere:
        print(line, file=sys.stderr)
    if result.refused:
        return SCRIPT_FAILED
    try:
        written = _write(result, ns, encoding)
    except OSError as exc:
        where = ns.output or ns.script
        return usage_error(PROG, f"cannot write {where!r} ({exc.__class__.__name__}: {exc.strerror or exc}); "
                                 "expected a writable file path")
    code = SCRIPT_FAILED if result.left or elsewhere else 0
    if ns.verify:
        code = max(code, _verify(result, ns, written, encoding))
    return code


def _write(result, ns: argparse.Namespace, encoding: str) -> str | None:
    """Write where asked (``-o``: always, so ``--verify`` never meets an older file there; ``--write``: when
    something changed), keeping the file's mode, and through a symlink; the path written, or None."""
    if ns.output is None and not (ns.write and result.text != result.source):
        return None
    target = ns.output if ns.output is not None else os.path.realpath(ns.script)
    if ns.output is not None and (target.endswith(("/", os.sep)) or os.path.isdir(target)):
        target = os.path.join(target, os.path.basename(ns.script))  # ``-o conv/``: the script's name inside it
    # ``-o conv/train.py`` with no conv/ yet: made, as the folder of a project's -o is (two measurers of set 29
    # met the error first)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    mode = os.stat(target).st_mode & 0o7777 if os.path.exists(target) else None
    write_atomically(target, lambda f: f.write(result.text.encode(encoding)))
    if mode is not None:
        os.chmod(target, mode)
    return target


def _verify(result, ns: argparse.Namespace, written: str | None, encoding: str) -> int:
    """Verify the converted script where it was written, the script itself when nothing changed, else a copy
    beside the script (its imports of sibling modules still resolve), removed afterwards."""
    path = written or (ns.script if result.text == result.source else None)
    temporary = path is None
    try:
        if path is None:
            folder = os.path.dirname(os.path.abspath(ns.script))
            fd, path = tempfile.mkstemp(prefix=".ddpkit-convert-", suffix=".py", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(result.text.encode(encoding))
        code, lines = verify_and_check(path, ns.script_args, ns.nproc_per_node, ns.steps)
    except OSError as exc:
        return usage_error(PROG, f"cannot write a copy to verify beside {ns.script!r} ({exc.strerror or exc}); "
                                 "pass -o PATH to a writable place")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted during --verify; nothing was left behind", file=sys.stderr)
        return 130
    finally:
        if temporary and path is not None and os.path.exists(path):
            os.unlink(path)
    for line in lines:
        print(line, file=sys.stderr)
    return code


def _companions(root: str, files: list[str], out: str) -> None:
    """The project's other files copied beside the converted ones (:func:`project.companions`), said."""
    copied, skipped = project.companions(root, files, out)
    if copied or skipped:
        print(f"{PROG}: {copied} other file(s) of the project copied to {out}"
              + (f"; not copied: {', '.join(skipped[:5])}" + (f" and {len(skipped) - 5} more" if len(skipped) > 5
                                                              else "") + " (link or copy what it reads)"
                 if skipped else ""), file=sys.stderr)


def _localized(plans: dict[str, Any], files: list[str], root_outer: tuple[str, ...]) -> None:
    """A copy written elsewhere (``-o OUT``) imports its own modules as the folder's (:func:`.project.localize`):
    the package path the original reached them by (TCN's ``from TCN.mnist_pixel.utils import``) leads nowhere
    there, or back to the unconverted originals."""
    from ddpkit.commands.convert.plan import Edit  # (libcst, optional: imported where convert_file did)

    for rel in files:
        result = plans[rel]
        text, lines = project.localize(result.text, root_outer, files)
        if lines and not result.refused:
            result.text = text
            result.edits.extend(Edit(n, "an import of the project's own module through its package path -> the "
                                     "folder's module", "the copy in OUT has no package around it: the folder's "
                                     "name finds the converted module beside it") for n in lines)


def _main_many(ns: argparse.Namespace) -> int:
    """A folder, or a script with the modules it imports (:mod:`ddpkit.commands.convert.project`): every file
    converted, each said; nothing written unless none is refused."""
    root, files = project.files_of(ns.script, ns.imports)
    shown = os.path.dirname(ns.script) if not os.path.isdir(ns.script) and \
        os.path.abspath(os.path.dirname(ns.script) or ".") == root else os.path.relpath(root)
    encodings: dict[str, str] = {}

    def one(rel: str, names: crossing.Crossing | None) -> Any:
        result, encodings[rel] = convert_file(os.path.join(root, rel), ns.per_process_batch, names)
        return result

    # a model or loader one file uses and another builds: converted there
    plans = crossing.settle(files, one, project.outer(root))
    if ns.output:
        _localized(plans, files, project.outer(root))
    done = [(rel, os.path.join(shown, rel), plans[rel], encodings[rel]) for rel in files]
    if ns.json:
        print(json.dumps({"files": [{"script": name, "refused": r.refused, "changed": r.text != r.source,
                                     "edits": [vars(e) for e in r.edits], "left": [vars(x) for x in r.left],
                                     "kept": [vars(k) for k in r.kept], "diff": _diff(r, name)}
                                    for _, name, r, _ in done]}))
    else:
        sys.stdout.write("".join(_diff(r, name) for _, name, r, _ in done))
    for _, name, r, _ in done:
        if r.edits or r.left or r.refused or r.kept:
            for line in report(r, name):
                print(line, file=sys.stderr)
    refused = [name for _, name, r, _ in done if r.refused]
    changed = sum(r.text != r.source for _, _, r, _ in done)
    if refused:
        print(f"{PROG}: refused: nothing written for any of the {len(done)} files ({', '.join(refused)} "
              "cannot be converted safely: see above)", file=sys.stderr)
        return SCRIPT_FAILED
    print(f"{PROG}: {changed} of {len(done)} file(s) changed", file=sys.stderr)
    try:
        for rel, _, r, encoding in done:
            target = os.path.join(ns.output, rel) if ns.output else os.path.realpath(os.path.join(root, rel))
            if ns.output or (ns.write and r.text != r.source):
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                data = r.text.encode(encoding)
                write_atomically(target, lambda f: f.write(data))  # noqa: B023 (called at once)
        if ns.output:
            _companions(root, files, ns.output)
            for line in project.moved_file_paths(root, ns.output, {rel: r.source for rel, _, r, _ in done}):
                print(f"{PROG}: {line}", file=sys.stderr)
    except OSError as exc:
        return usage_error(PROG, f"cannot write {ns.output or root!r} ({exc.__class__.__name__}: "
                                 f"{exc.strerror or exc}); expected a writable folder")
    outside = trainedelsewhere.outside(ns.script, plans[files[0]], [r for _, _, r, _ in done])
    for line in outside:
        print(line, file=sys.stderr)
    code = SCRIPT_FAILED if any(r.left for _, _, r, _ in done) or outside else 0
    if ns.verify:
        entry = os.path.join(ns.output, files[0]) if ns.output else os.path.join(root, files[0])
        verified, lines = verify_and_check(entry, ns.script_args, ns.nproc_per_node, ns.steps)
        for line in lines:
            print(line, file=sys.stderr)
        code = max(code, verified)
    return code
