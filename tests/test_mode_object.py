"""The mode is an object (issue 27): each mode builds its own typed, frozen options from prepare_model's
keyword arguments, the table loads without torch, and prepare_model names no mode."""
import ast
import dataclasses
import inspect
import subprocess
import sys

import pytest

from ddpkit import model, strategy

CALL = dict(sync_batchnorm=False, check_sync_every=3, comm="c", shard=[object], init_fn=print)


def test_each_mode_keeps_the_options_it_uses_and_ignores_the_rest():
    ddp = strategy.get("ddp").options({**CALL, "find_unused_parameters": True, "tools": None})
    fsdp = strategy.get("fsdp").options({**CALL, "reshard_after_forward": False})
    single, dp = strategy.get("single").options({**CALL, "x": 1}), strategy.get("dp").options(CALL)
    assert (ddp.sync_batchnorm, ddp.check_sync_every, ddp.comm, dict(ddp.ddp_kwargs)) == \
        (False, 3, "c", {"find_unused_parameters": True})
    assert (fsdp.sync_batchnorm, fsdp.shard, fsdp.init_fn, dict(fsdp.fsdp_kwargs)) == \
        (False, [object], print, {"reshard_after_forward": False})
    assert not hasattr(fsdp, "check_sync_every") and not hasattr(fsdp, "comm")  # DDP's: no replicas to check
    assert [f.name for f in dataclasses.fields(single)] == ["init_fn"] == [f.name for f in dataclasses.fields(dp)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ddp.check_sync_every = 0  # type: ignore[misc]


def test_the_old_class_names_are_the_new_ones():
    assert strategy.Distributed is strategy.DDPStrategy and strategy.Sharded is strategy.FSDPStrategy
    assert strategy.DataParallel is strategy.DataParallelStrategy
    assert type(strategy.get("fsdp")) is strategy.FSDPStrategy
    assert issubclass(strategy.FSDPStrategy, strategy.DDPStrategy)


def test_the_table_and_the_launch_config_load_without_torch():
    code = ("import sys; from ddpkit.strategies import table; import ddpkit.launcher.config as c; "
            "assert table.get('fsdp').multi_process and table.get('dp').min_gpus == 2; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_prepare_model_names_no_mode():
    """No mode name compared, no ``mode.shards`` branch, no meta-device step: the mode's prepare does them."""
    body = ast.parse(inspect.getsource(model.prepare_model)).body[0]
    code = [n for n in body.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    words = {n.value for stmt in code for n in ast.walk(stmt) if isinstance(n, ast.Constant)} | \
        {n.attr for stmt in code for n in ast.walk(stmt) if isinstance(n, ast.Attribute)} | \
        {n.id for stmt in code for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    assert "prepare" in words  # the mode's own order
    assert not words & {"ddp", "fsdp", "dp", "single", "name", "shards", "meta", "on_meta", "materialize", "on_model"}


def test_a_mode_written_for_the_flat_wrap_keywords_gets_them_as_before():
    """Review of issue 27: plugins subclass the built-in modes and override ``wrap(model, state, **options)``.
    With typed options passed in their place, a sharding plugin crashed (positional call), a ddp plugin lost
    ``find_unused_parameters``, and a sharding plugin got a meta model materialised whole before its wrap."""
    import torch
    from torch import nn

    from ddpkit.core.process import State
    from ddpkit.runtime import instrument
    from ddpkit.strategies.meta import meta_build, on_meta

    seen = {}

    class Recording(strategy.Sharded):
        name = "recording-fsdp"

        def wrap(self, model, state, **options):
            seen.update(options, meta=on_meta(model))
            return model

    class Custom(strategy.Strategy):
        name = "custom"

        def wrap(self, model, state, **options):
            seen.update(custom=sorted(options))
            return model

    state = State(0, 0, 1, 1, 0, torch.device("cpu"), None, "x", "x")
    given = dict(sync_batchnorm=True, check_sync_every=0, comm=None, shard=None, init_fn=None,
                 find_unused_parameters=True)
    with meta_build():
        net = nn.Linear(2, 2)
    Recording().prepare(net, state, given, instrument.NONE)
    assert seen.pop("meta") is True and seen.pop("tools") is instrument.NONE and seen == given
    Custom().prepare(nn.Linear(2, 2), state, given, instrument.NONE)
    assert seen["custom"] == ["check_sync_every", "comm", "find_unused_parameters", "sync_batchnorm", "tools"]
    ddp = strategy.get("ddp").options({**given, "static_graph": True})
    assert dict(ddp.ddp_kwargs) == {"find_unused_parameters": True, "static_graph": True}


def test_a_keyword_spelled_like_the_kwargs_field_goes_to_the_wrapper_which_refuses_it():
    """Review of issue 27: prepare_model(net, ddp_kwargs={...}) was silently dropped; before it failed in DDP."""
    assert dict(strategy.get("ddp").options({"ddp_kwargs": {"find_unused_parameters": True}}).ddp_kwargs) == \
        {"ddp_kwargs": {"find_unused_parameters": True}}
    assert dict(strategy.get("fsdp").options({"fsdp_kwargs": {"x": 1}}).fsdp_kwargs) == {"fsdp_kwargs": {"x": 1}}
