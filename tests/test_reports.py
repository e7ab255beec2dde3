"""The fault reports' two halves (docs/architecture.md): a worker writes (ddpkit.runtime.faults), the launcher
reads (ddpkit.launcher.diagnosis, console, supervise), and the format between them lives once, in
ddpkit.core.reports, so the writer and the reader cannot drift apart."""
import ast
import pathlib

from ddpkit.core import process, reports
from ddpkit.launcher import console, diagnosis
from ddpkit.runtime import faults

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "ddpkit"


def test_a_written_traceback_block_is_read_back_whole_and_left_out_of_a_tail():
    text = "Traceback (most recent call last):\n  File \"t.py\", line 1\nKeyError: 'x\rmore'"
    tag = reports.block_tag("/tmp/ddpkit-report-one")
    block = reports.traceback_block(text, tag).split("\n")
    assert reports.block_length(block[0], tag) == len(block) - 1 == 4
    assert reports.block_length(block[0], None) == 4  # any tag
    assert reports.block_length(block[0], reports.block_tag("/tmp/another-launch")) == 0
    assert all(reports.block_length(line, tag) == 0 for line in block[1:])
    # the launcher's stderr tail drops the block's two marker lines and keeps what they enclose
    assert diagnosis._lines("\n".join(["before", *block, "after"])).split("\n") == \
        ["before", *block[1:-1], "after"]


def test_finished_reads_what_mark_finished_wrote(tmp_path):
    process.current().report_dir = str(tmp_path)
    try:
        faults.mark_finished(0)
    finally:
        process.current().report_dir = None
    assert diagnosis.finished(str(tmp_path), [0]) and not diagnosis.finished(str(tmp_path), [0, 1])


def test_the_worker_half_holds_no_reader_and_the_launcher_reads_no_worker_module():
    assert not hasattr(faults, "finished") and not hasattr(faults, "block_length")
    assert reports.peer_lost("[pair.cc:538] Connection closed by peer") and not reports.peer_lost("KeyError: 'x'")
    assert console.block_length is reports.block_length
    readers = ("console", "diagnosis")
    for name in readers:  # the launcher's readers take the format from core, not from the worker's module
        tree = ast.parse((SRC / "launcher" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m and m.startswith("ddpkit.runtime")}, (name, imported)
