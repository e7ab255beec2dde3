"""Issue 27.4: the tools' data lives on the tool side of the instrumentation seam. The library owns the hooks
(:class:`ddpkit.runtime.instrument.Hooks`) and the loaders' per-batch observer; verify and bench plug in through
the ``ddpkit.tools`` entry points, named by ``DDPKIT_TOOL``. In-process: these are pure decisions and one
loader, no process group."""
import importlib.metadata
import json
import types

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from ddpkit.data import streams
from ddpkit.data.loader import ShardedDataLoader
from ddpkit.data.samplers import ShardSampler
from ddpkit.runtime import instrument


def test_a_normal_run_looks_up_no_tool(monkeypatch):
    def no_lookup(*args, **kwargs):
        raise AssertionError("a normal run looked up the ddpkit.tools entry points")

    monkeypatch.setattr(importlib.metadata, "entry_points", no_lookup)
    assert instrument.from_env({}) is instrument.NONE
    assert instrument.from_env({"DDPKIT_MAX_STEPS": "5"}) is instrument.NONE  # a tool's variable alone: no tool
    assert instrument.NONE.train_batch(4) == 4 and instrument.NONE.uneven("pad") == "pad"


def test_the_commands_name_their_hooks_by_module_so_no_installed_metadata_is_needed(monkeypatch):
    """Review of issue 27: `make gpu-check` runs a CUDA python with src/ on PYTHONPATH and nothing installed;
    verify and bench named their hooks by entry point only, so every worker died at init ('installed: none')."""
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])  # no ddpkit metadata at all
    from ddpkit.commands.bench import command as bench
    from ddpkit.commands.verify import command as verify

    env = verify.run_env("/tmp/x", 2, 3, None, False)
    hooks = instrument.from_env({**env, "DDPKIT_VERIFY_OUT": "x"})
    assert type(hooks).__module__ == "ddpkit.commands.verify.hooks", env
    assert "ddpkit.commands.bench.hooks:from_env" in open(bench.__file__).read()
    assert type(instrument.from_env({"DDPKIT_TOOL": "ddpkit.commands.bench.hooks:from_env"})).__name__ == "BenchHooks"
    with pytest.raises(ValueError, match=r"^DDPKIT_TOOL='nope.mod:f' cannot be loaded \(No module named 'nope'\)"):
        instrument.from_env({"DDPKIT_TOOL": "nope.mod:f"})


@pytest.mark.parametrize("value,said", [("os:system", "its factory failed"), (":x", "cannot be loaded (Empty"),
                                        ("ddpkit.core.contract:TOOL", "its factory failed ('Var' object"),
                                        ("builtins:dict", "returned a dict, not")])
def test_a_crafted_tool_is_one_line_naming_the_variable(value, said):
    with pytest.raises(ValueError) as info:
        instrument.from_env({"DDPKIT_TOOL": value})
    assert str(info.value).startswith(f"DDPKIT_TOOL={value!r}") and said in str(info.value), str(info.value)


def test_a_tool_variable_without_a_tool_is_said_once_not_ignored_silently(capsys):
    assert instrument.from_env({"DDPKIT_MAX_STEPS": "7", "DDPKIT_BENCH_OUT": "/tmp/o"}) is instrument.NONE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpkit: warning: DDPKIT_MAX_STEPS, DDPKIT_BENCH_OUT set without "
                                               "DDPKIT_TOOL: ignored"), err
    assert instrument.from_env({}) is instrument.NONE and capsys.readouterr().err == ""


@pytest.mark.parametrize("value,why", [("{bad", "Expecting property name"), ('{"bucket": 5}', "unexpected keyword"),
                                       ("[1]", "not an object")])
def test_a_bad_comm_override_is_one_line_naming_the_variable(value, why):
    with pytest.raises(ValueError) as info:
        instrument.from_env({"DDPKIT_TOOL": "bench", "DDPKIT_COMM": value})
    text = str(info.value)
    assert text.startswith(f"DDPKIT_COMM={value!r} is not a JSON object of CommConfig fields") and why in text, text
    assert "\n" not in text


def test_verify_and_bench_are_plugged_in_by_their_entry_points():
    verify = instrument.from_env({"DDPKIT_TOOL": "verify", "DDPKIT_VERIFY_OUT": "x", "DDPKIT_BATCH_SCALE": "2",
                                  "DDPKIT_VERIFY_DROP": "2", "DDPKIT_MAX_STEPS": "3"})
    assert isinstance(verify, instrument.Hooks) and type(verify).__module__ == "ddpkit.commands.verify.hooks"
    assert (verify.train_batch(4), verify.train_batch(4, given_globally=True), verify.uneven("pad"),
            verify.multiple(), verify.keep_dropout) == (8, 4, "drop", 2, False)
    bench = instrument.from_env({"DDPKIT_TOOL": "bench", "DDPKIT_BENCH_OUT": "/tmp", "DDPKIT_MAX_STEPS": "3",
                                 "DDPKIT_COMM": '{"bucket_mb": 5}'})
    assert type(bench).__module__ == "ddpkit.commands.bench.hooks"
    assert bench.comm_config(None).bucket_mb == 5 and bench.train_batch(4) == 4 and bench.multiple() is None


def test_an_unknown_tool_is_one_line_naming_the_installed_ones():
    with pytest.raises(ValueError) as err:
        instrument.from_env({"DDPKIT_TOOL": "nope"})
    line = str(err.value)
    assert "\n" not in line and "DDPKIT_TOOL='nope'" in line and "bench, plan, verify" in line, line


def _loader(n: int = 20, batch: int = 2) -> ShardedDataLoader:
    return ShardedDataLoader(TensorDataset(torch.arange(n)), batch_size=batch,
                             sampler=ShardSampler(n, 0, 1, shuffle=False))


def cap(loader, k: int):
    """An observer that ends every pass once ``loader`` has handed out ``k`` batches in all."""
    return lambda: loader.steps_taken < k


def test_an_observer_ends_a_pass_at_the_batch_it_refuses_and_loaders_carry_no_tool_fields():
    loader = _loader()
    seen: list[int] = []
    loader.observe(cap(loader, 3))
    loader.observe(lambda: seen.append(loader.steps_taken))  # returns None: only watches
    assert [x.tolist() for (x,) in loader] == [[0, 1], [2, 3], [4, 5]]
    assert (loader.steps_taken, loader.epoch, seen) == (3, 1, [0, 1, 2])  # a pass that handed out batches: its epoch
    assert list(loader) == [] and loader.epoch == 1  # capped: a pass that hands out nothing moves nothing
    assert not hasattr(loader, "max_steps") and not hasattr(loader, "step_times")


class Count(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(20))


def test_a_stream_loader_observer_ends_the_pass_the_same_way():
    state = types.SimpleNamespace(rank=0, world_size=1, is_main=True)
    loader = streams.stream_loader(Count(), 2, state, train=True, uneven="drop", shuffle=False, seed=0,
                                   shuffle_buffer=1, collective_forward=False)
    loader.observe(cap(loader, 3))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]] and loader.epoch == 1
    assert not hasattr(loader, "max_steps") and not hasattr(loader, "step_times")


def test_bench_caps_its_loaders_and_writes_the_times_it_always_wrote(tmp_path):
    bench = instrument.from_env({"DDPKIT_TOOL": "bench", "DDPKIT_BENCH_OUT": str(tmp_path), "DDPKIT_MAX_STEPS": "4"})
    hooks: list = []
    loader = _loader()
    bench.on_loader(loader, 1, lambda: {"global_batch": 2, "mode": "single", "device": "cpu"}, hooks.append)
    assert len([b for epoch in range(3) for b in loader]) == 4  # the cap holds across passes
    [write] = hooks
    write()
    record = json.loads((tmp_path / "rank1.json").read_text())
    assert set(record) == {"times", "ddp", "global_batch", "mode", "device"} and len(record["times"]) == 4
    assert record["times"] == sorted(record["times"]) and record["ddp"] == []
