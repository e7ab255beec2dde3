"""``ddpkit convert`` in process: the corpus's expected diffs, idempotence, refusals, crafted files, and the
decisions one at a time on small scripts shaped like the public ones (the multi-process proof is
tests/test_convert_corpus.py).

Regenerate the expected diffs after an intended change of the converter (and read them):
``python tests/test_convert.py --regenerate``.
"""
import json
import re
import sys

import pytest

from conftest import ROOT, run_cmd

pytest.importorskip("libcst")

from ddpkit.commands.check.command import analyze  # noqa: E402
from ddpkit.commands.convert.command import _diff, main  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

CORPUS = ROOT / "tests" / "convert_corpus"
EXPECTED = CORPUS / "expected"
CONVERTIBLE = ["mnist_cnn", "vae", "device_flag", "amp_scheduler", "char_transformer", "cifar_dataparallel",
               "dcgan_accel", "quickstart_notebook"]


def expected_diff(name):
    result = plan((CORPUS / f"{name}.py").read_text())
    return result, _diff(result, f"{name}.py")


@pytest.mark.parametrize("name", CONVERTIBLE + ["word_lm"])
def test_the_corpus_converts_to_its_expected_diff(name):
    result, diff = expected_diff(name)
    assert diff == (EXPECTED / f"{name}.diff").read_text(), f"regenerate with python {__file__} --regenerate"


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_a_converted_script_has_nothing_left_for_check_or_a_second_conversion(name):
    first = plan((CORPUS / f"{name}.py").read_text())
    converted = first.text
    assert analyze(converted) == []
    again = plan(converted)  # (a line left to the user the first time stays left: the VAE's seeded noise)
    def said(left):  # (its line numbers move with the conversion's edits)
        return {re.sub(r"\d+", "", x.what) for x in left}
    assert again.text == converted and again.edits == [] and said(again.left) <= said(first.left), again.left


@pytest.mark.parametrize("path", sorted((ROOT / "tests" / "realworld").glob("*.py")) +
                         sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_scripts_converted_by_hand_have_nothing_to_change(path):
    result = plan(path.read_text())
    assert result.text == result.source and result.edits == [] and not result.refused, result.left


def test_the_word_lm_is_refused_with_the_line_and_nothing_is_written(tmp_path, capsys):
    script = tmp_path / "word_lm.py"
    script.write_text((CORPUS / "word_lm.py").read_text())
    before = script.read_bytes()
    assert main(["--write", str(script)]) == 1
    err = capsys.readouterr().err
    assert "refused: nothing written" in err and "fed by hand" in err and f"{script}:" in err
    assert script.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["word_lm.py"]


def test_write_converts_in_place_and_a_second_run_says_nothing_to_change(tmp_path, capsys):
    script = tmp_path / "mnist_cnn.py"
    script.write_text((CORPUS / "mnist_cnn.py").read_text())
    assert main(["--write", str(script)]) == 0
    assert "ddpkit.prepare_model(Net())" in script.read_text()
    capsys.readouterr()
    assert main([str(script)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"nothing to change in {script}" in captured.err


def test_json_lists_edits_with_their_lines(capsys):
    assert main(["--json", str(CORPUS / "device_flag.py")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["refused"] and report["changed"] and report["left"] == []
    lines = {e["line"]: e["what"] for e in report["edits"]}
    assert "ddpkit.prepare_model(model)" in lines[87] and "train=False" in lines[84]


# Files someone else crafted: never run, never half-written, one line each
@pytest.mark.parametrize("content, expected", [
    (b"def f(:\n    pass\n", "is not Python 3"),
    (b"\xff\xfe\x00garbage\x00" * 10, "expected a .py file"),
    (b"x = " + b"(" * 3000 + b"1" + b")" * 3000 + b"\n", "too many nested parentheses"),  # libcst: a segfault
    (b"x = " + b" + ".join([b"1"] * 30000) + b"\n", "RecursionError"),
    (b"x = 1\x00\n", "is not Python 3"),
])
def test_a_crafted_file_is_one_line_and_exit_2(tmp_path, capsys, content, expected):
    script = tmp_path / "crafted.py"
    script.write_bytes(content)
    assert main(["--write", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpkit convert: error:") and expected in err[0], err
    assert script.read_bytes() == content


def test_converting_never_runs_the_script(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "evil.py"
    script.write_text(f"import os\nopen({str(marker)!r}, 'w').close()\nos.system('touch {marker}')\n"
                      "print('hello')\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "convert", "--write", str(script)])
    assert r.returncode == 0, r.stderr
    assert not marker.exists() and "ddpkit.print('hello')" in script.read_text()


def test_arguments_for_the_script_need_verify(capsys):
    assert main([str(CORPUS / "vae.py"), "--epochs", "1"]) == 2
    assert "add --verify" in capsys.readouterr().err


if __name__ == "__main__" and "--regenerate" in sys.argv:
    EXPECTED.mkdir(exist_ok=True)
    for corpus_name in CONVERTIBLE + ["word_lm"]:
        (EXPECTED / f"{corpus_name}.diff").write_text(expected_diff(corpus_name)[1])
        print(f"wrote {EXPECTED / corpus_name}.diff")


# the CLI on what a reviewer handed it
def test_output_is_always_written_its_folder_made_and_an_unwritable_path_is_one_line(tmp_path, capsys):
    done = tmp_path / "done.py"
    done.write_text((ROOT / "examples" / "digits.py").read_text())
    out = tmp_path / "out.py"
    out.write_text("stale")
    assert main(["-o", str(out), str(done)]) == 0 and out.read_text() == done.read_text()  # not the stale one
    capsys.readouterr()
    made = tmp_path / "conv" / "deeper" / "out.py"  # set 29: ``-o conv/train.py`` before conv/ exists
    assert main(["-o", str(made), str(done)]) == 0 and made.read_text() == done.read_text()
    capsys.readouterr()
    assert main(["-o", str(done / "out.py"), str(CORPUS / "vae.py")]) == 2  # under a file: no folder can be made
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ddpkit convert: error: cannot write") and "Traceback" not in "".join(err)


def test_write_keeps_crlf_a_bom_the_encoding_the_mode_and_writes_through_a_symlink(tmp_path):
    source = (CORPUS / "device_flag.py").read_text()
    crlf = tmp_path / "crlf.py"
    crlf.write_bytes(source.replace("\n", "\r\n").encode())
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbf" + source.encode())
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + source.encode())
    target = tmp_path / "target.py"
    target.write_text(source)
    target.chmod(0o755)
    link = tmp_path / "link.py"
    link.symlink_to(target)
    for path in (crlf, bom, latin, link):
        assert main(["--write", str(path)]) == 0, path
    assert b"\r\n" in crlf.read_bytes() and b"\n" not in crlf.read_bytes().replace(b"\r\n", b"")
    assert bom.read_bytes().startswith(b"\xef\xbb\xbf") and b"caf\xe9" in latin.read_bytes()
    assert link.is_symlink() and "ddpkit.init" in target.read_text() and target.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("argv, expected", [
    (["ROOT"], "holds no .py file"),  # a folder converts its .py files: this one has none
    (["NB"], "is a notebook"),
    (["--verify", "--nproc-per-node", "1", "SCRIPT"], "--verify compares >= 2 processes"),
])
def test_what_is_no_script_or_no_comparison_is_one_line(tmp_path, capsys, argv, expected):
    notebook = tmp_path / "t.ipynb"
    notebook.write_text('{"cells": []}')
    paths = {"ROOT": str(tmp_path), "NB": str(notebook), "SCRIPT": str(CORPUS / "vae.py")}
    assert main([paths.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_a_last_line_without_a_newline_is_marked_in_the_diff(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("import torch\nprint('x')")
    main([str(script)])
    assert "\\ No newline at end of file" in capsys.readouterr().out
