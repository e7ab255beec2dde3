"""The phase report's readers bounded like checkpoints' (issue 45): a crafted ``phases.json`` or peer window (huge
integers, NaN, deep nesting, millions of values) is one warning line or a skipped window, never a traceback, and
costs no more than a real report would; a real launch where a rank posts crafted windows still exits 0."""
import json
import re
import resource

import pytest
import torch.distributed as dist

from conftest import launch, ok
from ddpkit.core import straggler
from ddpkit.launcher import phase_report
from ddpkit.runtime import phase_json, phase_store

BASE = {"data": 1.0, "compute": 10.0, "comm": 5.0, "optimizer": 1.0, "other": 1.0}
WINDOW = straggler.dumps(straggler.window(1, BASE, steps=4, index=0))


def with_field(text, field, literal):
    """``text`` (a window's JSON) with ``field``'s value written as ``literal``, whatever Python would refuse."""
    value = json.loads(text)
    old = json.dumps(value["ms"][field] if field in BASE else value[field], separators=(",", ":"))
    return text.replace(f'"{field}":{old}', f'"{field}":{literal}', 1)


def report_of(window_text, missing="[]", extra=""):
    return f'{{"v":1,"ranks":[{window_text}],"missing":{missing}{extra}}}'.encode()


CRAFTED_WINDOWS = {
    "ms int of 400 digits": with_field(WINDOW, "data", "1" + "0" * 399),  # was OverflowError in float()
    "ms int of 4000 digits": with_field(WINDOW, "data", "1" + "0" * 3999),
    "ms int past Python's 4300 digits": with_field(WINDOW, "data", "9" * 5000),
    "rank of 4000 digits": with_field(WINDOW, "rank", "1" * 4000),
    "NaN": with_field(WINDOW, "data", "NaN"),
    "Infinity": with_field(WINDOW, "comm", "-Infinity"),
    "1e999": with_field(WINDOW, "data", "1e999"),
    "a float of 10**5 digits": with_field(WINDOW, "data", "1." + "1" * 100_000),
    "negative steps": with_field(WINDOW, "steps", "-3"),
    "steps a string": with_field(WINDOW, "steps", '"4"'),
    "host a list": with_field(WINDOW, "host", "[1,2]"),
    "deep nesting": "[" * 100_000 + "]" * 100_000,  # was RecursionError
    "deep nesting inside": with_field(WINDOW, "host", "[" * 5000 + "]" * 5000),
    "not UTF-8": b"\xff\xfe{",
}


@pytest.mark.parametrize("name", CRAFTED_WINDOWS)
def test_a_crafted_phases_json_is_one_warning_line_at_the_launcher(tmp_path, name):
    raw = CRAFTED_WINDOWS[name]
    raw = raw if isinstance(raw, bytes) else report_of(raw) if raw.startswith("{") else raw.encode()
    (tmp_path / "phases.json").write_bytes(raw)
    text = phase_report.summary(str(tmp_path), str(tmp_path / "logs"))
    assert text.startswith("ddpkit: warning: the phase report") and "\n" not in text, text
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("raw", [
    report_of(WINDOW, missing="[" + "0," * 10**6 + "0]"),  # a million missing ranks: refused before decoding
    report_of(WINDOW, missing="[-1]"), report_of(WINDOW, extra=',"warmup":' + "7" * 4000),
    report_of(WINDOW, extra=',"warmup":-5'), b"[" + b"[[[[]]]]," * 600_000 + b"[]]",
    b'{"v":1,"ranks":[' + b"{}," * 10**6 + b'{}],"missing":[]}'])
def test_a_report_with_too_many_or_wrong_values_is_one_warning_line(tmp_path, raw):
    (tmp_path / "phases.json").write_bytes(raw)
    text = phase_report.summary(str(tmp_path), str(tmp_path / "logs"))
    assert text.startswith("ddpkit: warning: the phase report") and "\n" not in text, text


def test_the_largest_file_read_costs_bounded_memory(tmp_path):
    """64 MB of 900-deep lists (under the recursion limit) would be ~2 GB of lists; refused at a byte count."""
    raw = (b"[" * 900 + b"]" * 900 + b",") * ((phase_report.MAX_BYTES - 2) // 1801)
    (tmp_path / "phases.json").write_bytes(b"[" + raw[:-1] + b"]")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text = phase_report.summary(str(tmp_path), str(tmp_path / "logs"))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
    assert "JSON values, more than" in text and grown_mb < 300, (text, grown_mb)


def test_a_real_report_still_reads_whole(tmp_path):
    report = straggler.report([straggler.window(r, BASE, steps=9, host="node-a") for r in range(64)], [64])
    raw = straggler.dumps(report).encode()
    assert phase_json.report(raw) == straggler.parse_report(raw)
    assert len(phase_json.window(straggler.dumps(report["ranks"][3]))["ms"]) == 5


@pytest.mark.parametrize("name", CRAFTED_WINDOWS)
def test_a_crafted_peer_window_is_skipped_and_crafted_totals_are_a_missing_rank(name, capsys):
    raw = CRAFTED_WINDOWS[name]
    store = dist.HashStore()
    phase_store.put(store, phase_store.key("p/", 0, 0), straggler.window(0, BASE, index=0))
    store.set(phase_store.key("p/", 0, 1), raw)
    assert phase_store.gather(store, "p/", 0, world_size=2) == []
    assert capsys.readouterr().err.count("\n") == 1  # one line: "window 0 unreadable (...); skipped"
    store.set("p/total/1", raw)
    windows, missing = phase_store.final_totals(store, "p/", straggler.window(0, BASE), 2, wait_s=1.0)
    assert [w["rank"] for w in windows] == [0] and missing == [1]


def test_a_peer_window_larger_than_any_real_one_is_refused_unread():
    with pytest.raises(straggler.ReportError, match="bytes, more than 4096"):
        phase_json.window(with_field(WINDOW, "host", '"' + "h" * 5000 + '"'))


CRAFTING_RANK = """
import os, sys, torch, ddpkit
from ddpkit.runtime import phase_store
if os.environ["RANK"] == "1":  # this rank posts a crafted window (an int of 400 digits) instead of its own
    phase_store.put = lambda store, where, win: store.set(where, sys.argv[1])
ddpkit.init()
model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
ddpkit.shutdown()
print("done")
"""


def test_a_launch_where_a_rank_posts_crafted_windows_ends_cleanly(tmp_path):
    script = tmp_path / "crafting.py"
    script.write_text(CRAFTING_RANK)
    crafted = with_field(WINDOW, "data", "1" + "0" * 399)
    res = ok(launch(script, crafted, launcher_args=["--phase-window", "2", "--log-dir", tmp_path / "logs"]))
    assert "Traceback" not in res.stderr and "OverflowError" not in res.stderr, res.stderr
    # which window rank 0 reads first depends on when rank 1 posts: any one of them is the crafted one
    assert re.search(r"phase report: window \d+ unreadable \(it holds an integer of 400 digits", res.stderr), res.stderr
    assert "no figures from rank(s) 1" in res.stderr, res.stderr
