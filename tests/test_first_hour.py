"""Issue 26: what a converted public script hits in its first hour. A prepared model keeps the user's methods
and attributes in every mode (real launches), the command line's small items, and ``ddpkit.accumulate``."""
import json
import sys

import pytest

from conftest import WORKERS, launch, ok, run_cmd

WORKER = WORKERS / "first_hour.py"


def _methods(tmp_path, mode):
    if mode == "single":
        ok(run_cmd([sys.executable, str(WORKER), "methods", str(tmp_path)]))
    else:
        ok(launch(WORKER, "methods", tmp_path, launcher_args=("--mode", mode)))
    ranks = sorted(tmp_path.glob("methods-rank*.json"))
    assert len(ranks) == (1 if mode == "single" else 2)
    return [json.loads(p.read_text()) for p in ranks]


@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp"])
def test_a_prepared_model_keeps_the_users_methods_and_attributes(tmp_path, mode):
    """word_language_model's init_hidden, a VAE's decode, minGPT's configure_optimizers, plain attributes:
    'DDP' object has no attribute 'init_hidden' hit 3 of 5 public scripts."""
    for facts in _methods(tmp_path, mode):
        assert facts["mode"] == mode and facts["ntoken"] == 7
        assert facts["hidden"] == [[1, 3, 4], [1, 3, 4]] and facts["forward"] == [5, 3, 7]
        assert facts["grads_equal"], "a loss through model.decode(z) must train as the plain model's does"
        assert facts["temperature"] == [2.0, 2.0], "a write of the module's attribute must reach the module"
        assert facts["note"] == ["mine", False], "a new name stays on the wrapper"
        assert facts["own"]["keys"] == ["decoder.bias", "decoder.weight"]
        assert facts["unwrap_optimizer"]
        assert facts["item"], "model[-1] of a prepared nn.Sequential is the module's item (review: a TypeError)"
        if mode == "single":
            continue
        assert facts["own"]["module"] and facts["own"]["no_sync"] == (mode == "ddp")
        assert "has no attribute 'init_hiddn': looked up on ddpkit's" in facts["missing"]
        assert "WordLM" in facts["missing"]
        if mode == "fsdp":  # methods run as FSDP forwards and leave the parameters sharded
            assert facts["sharded_after"]
            assert "ddpkit.unwrap(model).configure_optimizers" in facts["optimizer"]
        else:
            assert facts["optimizer"] is True
        _assert_guards(facts["guards"], mode)


def _assert_guards(g, mode):
    """fsdp: no dangling view of a freed gathered parameter (it segfaulted), the root sharded again after a
    raise, a generator or a forward, an optimizer over the gathered copies refused; ddp/fsdp: layer writes
    through the wrapper refused (the reducer / the sharding never sees them)."""
    assert g["copy"] is None and g["unwrap_trains"], g
    if mode == "ddp":
        assert g["shadowed"] == ["model.logger is DDP's own attribute, not your Probe's: read yours as "
                                 "ddpkit.unwrap(model).logger"], g["shadowed"]
        assert g["copied_logger"] == "mine", "a deepcopy must not put DDP's logger into the user's module"
    assert g["after_forward"] and g["fails"][1] and g["rows"][1], g
    assert g["fails"][0] == "ValueError: k > 4", g
    if mode == "fsdp":
        for how in ("detach", "data", "row", "T"):
            assert g[how] and "ddpkit.unwrap(model).view" in g[how] and "storage" in g[how], (how, g[how])
        assert "ddpkit.unwrap(model).configure_optimizers" in g["opt_wrapper"], g
        assert "generator" in g["rows"][0], g
    else:
        assert all(g[how] is None for how in ("detach", "data", "row", "T", "opt_wrapper")), g
        assert g["rows"][0] is None, g
    for case in ("replace", "add", "param"):
        assert g[case] and "before ddpkit.prepare_model(model)" in g[case] and "\n" not in g[case], (case, g[case])


def test_the_wrappers_read_the_modules_names_and_write_the_modules_own():
    """In-process, DataParallel's wrapper on the CPU (the same mixin as DDP's and FSDP's)."""
    import copy

    from torch import nn

    from ddpkit.strategies.dp_wrapper import DP

    class Net(nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.scale = 1.0

        def twice(self, x):
            return 2 * x

    model = DP(Net())
    assert model.twice(3) == 6 and model.scale == 1.0 and model.in_features == 2
    assert model.module is not None and list(model.state_dict()) == ["weight", "bias"]
    model.scale = 3.0  # the module's: its own code reads it
    assert model.module.scale == 3.0 and "scale" not in model.__dict__
    model.extra = 1  # neither had it: the wrapper's, as in torch
    assert model.extra == 1 and "extra" in model.__dict__ and not hasattr(model.module, "extra")
    model.training = False  # the wrapper's own name stays the wrapper's
    assert model.module.training is True
    with pytest.raises(AttributeError, match=r"^DP\(Net\) has no attribute 'nope': looked up on ddpkit's DP "
                                             r"wrapper, then on your Net module"):
        _ = model.nope
    clone = copy.deepcopy(model)
    assert clone.twice(2) == 4 and clone.module is not model.module and not hasattr(model, "__deepcopy__")


def test_a_property_that_raises_says_its_own_error_and_writes_run_no_getter():
    """A property whose body raises AttributeError was reported as "has no attribute ... check the name";
    a write tested hasattr(), which ran the getter, found nothing, and left the value on the wrapper."""
    import warnings

    from torch import nn

    from ddpkit.strategies.dp_wrapper import DP

    class Net(nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.device_ids = ["mine"]  # DataParallel's own name too

        @property
        def broken(self):
            return self.tokenizer  # not loaded

        @property
        def temperature(self):
            return self._temperature  # set by the setter only

        @temperature.setter
        def temperature(self, value):
            self._temperature = float(value)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DP(Net())
    said = [str(w.message) for w in caught]
    assert said == ["model.device_ids is DP's own attribute, not your Net's: read yours as "
                    "ddpkit.unwrap(model).device_ids"], said
    with pytest.raises(AttributeError, match="'Net' object has no attribute 'tokenizer'"):
        _ = model.broken
    model.temperature = 2  # the module's property: its setter runs
    assert model.module._temperature == 2.0 and "temperature" not in model.__dict__ and model.temperature == 2.0


def test_a_misspelt_option_is_refused_not_prefix_matched():
    """`--nproc-per-nod 2` ran as --nproc-per-node 2 (argparse's prefix matching); every ddpkit parser refuses it."""
    from ddpkit.commands import consolidate as shards
    from ddpkit.commands import launch
    from ddpkit.commands.bench import command as bench
    from ddpkit.commands.check import command as check
    from ddpkit.commands.verify import command as verify
    from ddpkit.core import errors
    for build in (launch.build_parser, verify.build_parser, check.build_parser, bench.build_parser,
                  shards.build_parser):
        assert build().allow_abbrev is False, build.__module__
    with pytest.raises(errors.UsageError,
                       match="unrecognized arguments: --nproc-per-nod; did you mean --nproc-per-node"):
        launch.build_parser().parse_args(["--nproc-per-nod", "2", "train.py"])


def test_a_subcommand_says_its_version(capsys):
    """`ddpkit launch --version` said "the following arguments are required: script"."""
    from importlib.metadata import version

    from ddpkit.commands import launch
    with pytest.raises(SystemExit) as exit_:
        launch.build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"ddpkit {version('ddpkit')}\n"


def test_version_and_help_go_to_stdout_with_exit_0(capsys):
    from importlib.metadata import version

    from ddpkit.commands import cli
    assert cli.main(["--version"]) == 0
    out, err = capsys.readouterr()
    assert out == f"ddpkit {version('ddpkit')}\n" and not err
    assert cli.main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: ddpkit COMMAND") and "--version" in out and not err
    assert cli.main(["lanch"]) == 2  # a wrong command: usage and the error on stderr
    out, err = capsys.readouterr()
    assert not out and "ddpkit: error: unknown command 'lanch'" in err


def test_the_package_lists_its_api_only_and_spawn_error_is_top_level():
    import ddpkit
    from ddpkit.launcher.spawn import SpawnError

    assert ddpkit.SpawnError is SpawnError and "SpawnError" in ddpkit.__all__
    listed = dir(ddpkit)
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(listed), listed
    assert {"init", "prepare_model", "spawn", "SpawnError", "__version__"} <= set(listed)


def test_accumulate_decides_per_micro_step_and_ends_each_epoch_with_a_sync():
    import ddpkit

    plan = [(m.sync, m.size) for m in (ddpkit.accumulate(None, i, steps=4, total=10) for i in range(10))]
    assert plan == [(False, 4)] * 3 + [(True, 4)] + [(False, 4)] * 3 + [(True, 4), (False, 2), (True, 2)]
    assert [ddpkit.accumulate(None, i, steps=3).sync for i in range(7)] == [False, False, True] * 2 + [False]
    assert all(ddpkit.accumulate(None, i, steps=1, total=3).sync for i in range(3))
    with pytest.raises(ValueError, match=r"accumulate\(step=10, steps=4, total=10\): expected .* total=len\(loader\)"):
        ddpkit.accumulate(None, 10, steps=4, total=10)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_accumulated_steps_equal_one_process_with_the_big_batch(tmp_path, mode):
    """Accelerate's accumulate / Fabric's no_backward_sync, in torch's words: the non-final micro-steps skip
    the gradient reduction, and an epoch of 10 micro-batches with steps=4 updates after 4, 8 and 10."""
    import torch

    ok(run_cmd([sys.executable, str(WORKER), "accumulate", str(tmp_path)]))
    ok(launch(WORKER, "accumulate", tmp_path, launcher_args=("--mode", mode)))
    ref, got = torch.load(tmp_path / "accumulate-single.pt"), torch.load(tmp_path / f"accumulate-{mode}.pt")
    epoch = [False, False, False, True, False, False, False, True, False, True]
    assert got["flags"] == epoch * 2 and got["synced"] == epoch * 2
    for name, value in ref["weights"].items():
        assert torch.allclose(value.double(), got["weights"][name].double(), rtol=0, atol=1e-6), name


def test_a_wrapper_without_no_sync_points_at_the_helper_every_mode_has():
    """fsdp's wrapper has no DDP-style `model.no_sync`: the error said 'check the name on Net'."""
    from torch import nn

    from ddpkit.strategies.forwarding import ForwardsAttributes

    class Wrapper(ForwardsAttributes, nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.start_forwarding()

    with pytest.raises(AttributeError, match=r"'no_sync'.*use ddpkit.no_sync\(model\) or ddpkit.accumulate"):
        getattr(Wrapper(nn.Linear(2, 2)), "no_sync")  # noqa: B009 - the read is the test


def test_a_stateless_module_may_be_set_a_sparse_result_is_new_and_equal_values_do_not_warn():
    """A second review: `model.criterion = nn.CrossEntropyLoss()` through DDP was refused though it holds
    nothing DDP syncs; a sparse result crashed the fsdp view guard (no storage); DDP's `device`, equal to the
    module's, warned on every prepare."""
    import warnings

    import torch
    from torch import nn

    from ddpkit.strategies.forwarding import ForwardsAttributes, _storages

    class Wrapper(ForwardsAttributes, nn.Module):
        refuses_layer_writes = True

        def __init__(self, module, **own):
            super().__init__()
            self.module = module
            self.__dict__.update(own)
            self.start_forwarding()

    net = nn.Linear(2, 2)
    net.dim, net.device = 4, torch.device("cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = Wrapper(net, dim=0, device=torch.device("cpu"))
    assert [str(w.message).split(" is ")[0] for w in seen] == ["model.dim"]
    model.criterion = nn.CrossEntropyLoss()  # no parameters, no buffers
    with pytest.raises(AttributeError, match="replace layers before ddpkit.prepare_model"):
        model.head = nn.Linear(2, 2)
    with pytest.raises(AttributeError, match="replace layers before ddpkit.prepare_model"):
        model.norm = nn.BatchNorm1d(2, affine=False)  # buffers only: DDP broadcasts those
    assert list(_storages([torch.eye(2).to_sparse(), torch.eye(2).to_sparse_csr()])) == []
