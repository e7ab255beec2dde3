"""examples/notebook.ipynb, executed headless in a real Jupyter kernel (nbclient + ipykernel), then the
interrupt and ten-launches cases in a kernel: the notebook form of ddpkit.spawn."""
import re
import time

import pytest

from conftest import ROOT, SCRATCH, alive

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
run_sync = pytest.importorskip("jupyter_core.utils").run_sync


def _outputs(cell):
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_the_example_notebook_trains_digits_on_two_processes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(SCRATCH)}}).execute()
    shown = _outputs(nb.cells[-1])
    accuracy = float(re.search(r"accuracy=([\d.]+)", shown).group(1))
    assert accuracy >= 0.95, shown
    assert "epoch 7 loss" in shown  # rank 0's ddpkit.print reaches the cell


def test_a_kernel_survives_an_interrupt_and_launches_ten_times():
    client = nbclient.NotebookClient(nbformat.v4.new_notebook(), timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(SCRATCH)}})
    with client.setup_kernel():
        def run(source):
            cell = nbformat.v4.new_code_cell(source)
            client.nb.cells.append(cell)
            client.execute_cell(cell, len(client.nb.cells) - 1)
            return _outputs(cell)

        run("import os, threading, time, torch, ddpkit\n"
            "def work(sleep):\n"
            "    state = ddpkit.init()\n"
            "    open(f'pid-{os.getpid()}', 'w').close()\n"
            "    end = time.time() + sleep\n"
            "    while time.time() < end:\n"
            "        ddpkit.barrier(); time.sleep(0.05)\n"
            "    return ddpkit.reduce(torch.tensor(1.0)).item()\n"
            "import glob; [os.remove(p) for p in glob.glob('pid-*')]")
        client.kc.execute("try:\n    ddpkit.spawn(work, 120.0, nproc_per_node=2)\n"
                          "except KeyboardInterrupt:\n    print('INTERRUPTED', time.time())")
        deadline = time.time() + 60
        while len(list(SCRATCH.glob("pid-*"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        workers = [int(p.name[4:]) for p in SCRATCH.glob("pid-*")]
        assert len(workers) == 2
        run_sync(client.km.interrupt_kernel)()  # what the notebook's stop button sends (to the process group)
        stopped = time.time()
        while time.time() < stopped + 10 and any(alive(pid) for pid in workers):
            time.sleep(0.1)
        assert not any(alive(pid) for pid in workers), "a worker outlived the interrupt"
        assert time.time() - stopped < 5
        shown = run("print('after', [ddpkit.spawn(work, 0.0, nproc_per_node=2) for _ in range(10)],"
                    " threading.active_count())")
        assert "after [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]" in shown, shown
