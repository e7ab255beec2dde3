"""The launch contract: one module names every variable; docs match it; the training path reads none."""
import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, ok, run_cmd
from ddpkit.core import contract
from ddpkit.runtime import instrument

SRC = ROOT / "src" / "ddpkit"


def test_docs_table_is_the_contract():
    assert contract.markdown_table() in (ROOT / "docs" / "environment.md").read_text(), \
        "docs/environment.md is stale: paste the output of `python -c 'from ddpkit.core import contract; " \
        "print(contract.markdown_table())'` under its heading"


def test_no_variable_name_is_spelled_outside_the_contract():
    names = {v.name for v in contract.VARIABLES}
    spelled = []
    for path in SRC.glob("*.py"):
        if path.name == "contract.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.name}:{node.lineno} {node.value}")
    assert spelled == []


def test_model_and_data_read_no_environment():
    for path in (SRC / "model.py", *(SRC / "data").glob("*.py")):
        assert "os.environ" not in path.read_text(), path.name


def test_readers_are_typed_and_fail_in_one_line():
    assert contract.MAX_STEPS.number({"DDPKIT_MAX_STEPS": "7"}) == 7
    with pytest.raises(contract.ContractError, match="DDPKIT_MAX_STEPS='x' is not an integer"):
        contract.MAX_STEPS.number({"DDPKIT_MAX_STEPS": "x"})
    with pytest.raises(contract.ContractError, match="DDPKIT_DEVICE='tpu' is not one of auto, cpu, cuda"):
        contract.DEVICE.choice({"DDPKIT_DEVICE": "tpu"})


def test_a_normal_run_has_no_tools():
    assert instrument.from_env({}) == instrument.NONE
    verify = instrument.from_env({"DDPKIT_TOOL": "verify", "DDPKIT_VERIFY_OUT": "x"})
    assert verify.keep_dropout is False  # verify turns dropout off


def test_reduce_mean_without_count_is_the_plain_mean_over_ranks(tmp_path):
    """Issue 12: reduce(x, "mean") raised and asked for count=."""
    script = tmp_path / "mean.py"
    script.write_text("import ddpkit\ns = ddpkit.init()\nprint('MEAN', ddpkit.reduce(float(s.rank + 1), 'mean'))\n")
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--log-dir",
                    str(tmp_path / "logs"), str(script)], timeout=120))
    assert "MEAN 1.5" in r.stdout


def test_every_exported_name_resolves():
    import ddpkit

    assert all(callable(getattr(ddpkit, name)) for name in ddpkit.__all__)
    assert Path(ddpkit.__file__).parent == SRC


def _render(obj) -> str:
    """``name(a, b=1, *, c=None, **kw)`` as the README writes a signature."""
    parts, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            default = "" if p.default is p.empty else \
                "=" + (f'"{p.default}"' if isinstance(p.default, str) else repr(p.default))
            parts.append(p.name + default)
    return f"{obj.__name__}({', '.join(parts)})"


def test_readme_api_table_matches_the_real_signatures():
    """Issue 12: the table had drifted (no comm, global_batch_size, shuffle)."""
    import ddpkit

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| name | what it does |"):readme.index("\nModes: ")]
    names = "".join(row.split(" | ")[0] for row in table.splitlines()[2:])  # the first column only
    shown = {m.group(1): m.group(0) for m in re.finditer(r"`(\w+)\([^`]*\)`", names)}
    assert set(shown) == set(ddpkit.__all__), set(ddpkit.__all__) ^ set(shown)
    for name, written in shown.items():
        assert written.strip("`") == _render(getattr(ddpkit, name)), name
