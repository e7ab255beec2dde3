"""``ddpkit.spawn(fn, *args, nproc_per_node=N)``: N data-parallel processes from a script or a notebook.

Each worker runs ``fn(*args, **kwargs)`` set up exactly as under ``ddpkit launch`` (the same environment
contract, loopback-only store, threads per process, per-rank logs, death with the parent); ``ddpkit.init()``
inside ``fn`` finds a ddp launch. torch's elastic launcher (``elastic_launch``) starts and watches them with
ddpkit's rendezvous handler. Rank 0's return value comes back; a failure is raised once, as a
:class:`SpawnError` whose text is the launcher's report (the rank that failed first and its traceback, or
the hang report).

Example (a notebook cell, or a script under ``if __name__ == "__main__":``)::

    def train(epochs):
        state = ddpkit.init()
        ...
        return accuracy

    accuracy = ddpkit.spawn(train, 3, nproc_per_node=2)

Start method: a function defined in a notebook or the REPL cannot be pickled by name, and a script read from
stdin cannot be re-run by a fresh interpreter, so workers are forked from the kernel; fork is unsafe once CUDA
is initialised in the parent, which is refused before anything starts. Functions in a script or a module start
with spawn (a fresh interpreter imports them).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import types
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ddpkit.core import contract, environment, process, reports
from ddpkit.launcher import config as launch
from ddpkit.launcher import console as logs
from ddpkit.launcher import phase_report, supervise
from ddpkit.runtime import group as runtime

_SIGNALS = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)]
_NO_NUMA_QUESTION = object()


class SpawnError(RuntimeError):
    """A worker failed: the message is ddpkit's report; ``exit_code`` is what ``ddpkit launch`` would return."""

    def __init__(self, report: str, exit_code: int):
        super().__init__(report)
        self.exit_code = exit_code


def choose_start_method(requested: str | None, interactive: bool, cuda_initialized: bool) -> str:
    """fork for notebook / REPL functions, spawn otherwise; refuses fork after CUDA is initialised.

    >>> choose_start_method(None, True, False), choose_start_method(None, False, True)
    ('fork', 'spawn')
    """
    method = requested or ("fork" if interactive else "spawn")
    if method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method={requested!r} is not one of fork, spawn, forkserver")
    if method == "fork" and cuda_initialized:
        fix = ("restart the kernel and call ddpkit.spawn before anything touches CUDA (torch.cuda.*, .cuda(), "
               "a CUDA tensor)") if interactive else "pass start_method='spawn' (or leave it unset)"
        raise RuntimeError(f"CUDA is already initialised in this process, and forked workers cannot use it "
                           f"(\"Cannot re-initialize CUDA in forked subprocess\"); {fix}")
    if method != "fork" and interactive:
        raise ValueError(f"start_method={method!r} imports the function by name in a fresh interpreter, but it (or "
                         "an argument) was defined in a notebook, the REPL or python -c, or the script was read from "
                         "stdin; move it into a .py module and run the script from its file, or leave start_method "
                         "unset")
    return method


def _interactive(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a fresh interpreter could not start the call, so the workers must be forked: the function (or
    an argument) was defined in ``__main__`` and ``__main__`` has no file to import it from (a notebook, the
    REPL, ``python -c``, a script fed on stdin), or ``__main__`` names a file that is not there (``python - <
    train.py``: ``'<stdin>'``, which multiprocessing's spawn re-runs in every worker whatever the function).

    >>> _interactive(print, (), {})  # a builtin, under a real script or doctest
    False
    """
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    by_name = getattr(getattr(main, "__spec__", None), "name", None)  # python -m pkg: re-imported by name
    if main_file is not None and not by_name and not os.path.isfile(main_file):
        return True
    if main_file is not None and os.path.isfile(main_file):
        return False  # spawn re-runs the script as __mp_main__: its functions and classes are found there
    return any(_from_main(obj) for obj in (fn, *args, *kwargs.values()))


def _from_main(obj: Any) -> bool:
    """``obj`` is pickled by a reference into ``__main__``, looked at one level deep: a function or class of
    ``__main__``, a ``functools.partial`` of one (``partial.__module__`` is ``'functools'``) or with one among its
    arguments, a bound method of one, or an instance of a ``__main__`` class (a callable object, a config)."""
    if isinstance(obj, functools.partial):
        return any(_from_main(part) for part in (obj.func, *obj.args, *obj.keywords.values()))
    if isinstance(obj, types.MethodType):
        return _from_main(obj.__func__) or _from_main(obj.__self__)
    if isinstance(obj, (types.FunctionType, type)):
        return obj.__module__ == "__main__"
    return type(obj).__module__ == "__main__"


class _Call:
    """``fn(*args, **kwargs)`` in a worker (torch's elastic_launch passes positional arguments only)."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]):
        self.fn, self.kwargs = fn, kwargs
        # torch's launcher names the run and its events after these
        self.__name__ = getattr(fn, "__name__", "fn")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        process.reset()  # a forked worker inherits the kernel's ddpkit state and its last failed cell
        # A fork copies the agent's handlers (which raise, for a traceback per worker). Ctrl-C / a kernel interrupt
        # reaches the whole process group: the agent stops the workers, so they ignore it and die by its SIGTERM.
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL)
        try:
            result = self.fn(*args, **self.kwargs)
        except BaseException as exc:
            # multiprocessing catches it before any excepthook: record it as ddpkit's hook would (the report
            # names this rank), and mark the failure so shutdown does not wait in a barrier for the peers
            sys.last_value = exc
            sys.excepthook(type(exc), exc, exc.__traceback__)
            raise
        runtime.shutdown()  # a forked worker ends in os._exit, without atexit: leave the group cleanly here
        return result


def spawn(fn: Callable[..., Any], *args: Any, nproc_per_node: int | None = None, mode: str = "ddp",
          device: str | None = None, start_method: str | None = None, log_dir: str = os.path.join("runs", "logs"),
          **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``nproc_per_node`` workers (default: the GPU count, else 2); rank 0's result.

    ``mode``: a multi-process mode (ddp, fsdp); ``device``: auto, cpu or cuda, as ``ddpkit launch --device``.
    Ctrl-C (a kernel interrupt) stops every worker and raises KeyboardInterrupt here.
    """
    import torch

    device = device or contract.DEVICE.text(os.environ)  # as ddpkit launch: the flag, else DDPKIT_DEVICE
    # counted with NVML, not the CUDA runtime: initialising the driver here would break every forked worker
    gpus = 0 if device == "cpu" else environment.visible_gpus()
    cfg = launch.LaunchConfig(script=f"<{getattr(fn, '__name__', 'fn')}>", module=True, mode=mode, device=device,
                              gpus=gpus, nproc_per_node=nproc_per_node or gpus or 2, log_dir=log_dir)
    if not cfg.strategy.multi_process:
        raise ValueError(f"mode={mode!r} runs one process; ddpkit.spawn starts a multi-process mode (ddp, fsdp)")
    method = choose_start_method(start_method, _interactive(fn, args, kwargs),
                                 torch.cuda.is_initialized() or environment.cuda_driver_started())
    run_dir = logs.new_run_dir(log_dir, keep=launch.DEFAULT_KEEP_LOGS)  # the newest folders stay, as under launch
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    try:
        with supervise.worker_environment(cfg) as (report_dir, _):  # the workers' contract with ddpkit.init()
            return _launch(cfg, fn, args, kwargs, method, run_dir, report_dir)
    finally:
        logs.release(run_dir)  # a notebook lives on: its finished folders can be rotated out by later launches
        for sig, handler in saved_signals.items():  # torch's agent installs its own; give the caller theirs
            signal.signal(sig, handler)


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return False


def _launch(cfg: launch.LaunchConfig, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], method: str,
            run_dir: str, report_dir: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ddpkit.launcher import rendezvous
    from ddpkit.launcher.console import ConsoleTail

    rendezvous.register()
    os.makedirs(run_dir, exist_ok=True)
    # before any worker speaks, as ddpkit launch says it: where a failed rank's whole output is
    print(f"ddpkit.spawn: {cfg.nproc_per_node} processes ({cfg.strategy.title}); per-rank logs in {run_dir}",
          file=sys.stderr, flush=True)
    # torch redirects a worker's output at the file-descriptor level, through sys.stdout.fileno(); a kernel that
    # does not capture its descriptors has streams without one: the workers then write through those streams
    redirects = Std.ALL if _has_fileno(sys.stdout) and _has_fileno(sys.stderr) else Std.NONE
    # torch's LaunchConfig without NUMA options asks torch.cuda.is_available(), which initialises the CUDA driver
    # here and breaks every forked worker, only to pick default NUMA options, which are None outside Meta: skip
    # the question (any options given) and keep that answer
    known = {f.name for f in fields(LaunchConfig)}
    numa: dict[str, Any] = {"numa_options": _NO_NUMA_QUESTION} if "numa_options" in known else {}  # torch >= 2.8
    # a worker's grace after SIGTERM; torch 2.11's LaunchConfig has no such field (its default, 30 s, applies)
    grace: dict[str, Any] = {"shutdown_timeout": 3} if "shutdown_timeout" in known else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc_per_node, run_id=os.path.basename(run_dir),
                          rdzv_backend=rendezvous.BACKEND, rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          start_method=method, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(log_dir=run_dir, redirects=redirects), **numa, **grace)
    if numa:
        config.numa_options = None
    tail = ConsoleTail(run_dir, {0}, 0, cfg.nproc_per_node, block_tag=reports.block_tag(report_dir))
    tail.start()
    try:
        with supervise.torch_logs(os.path.join(run_dir, "launcher.log"), verbose=False):
            results = elastic_launch(config, _Call(fn, kwargs))(*args)
    except ChildFailedError as exc:
        tail.stop()
        code, text = supervise.failure_report(exc, report_dir, supervise.stderr_tails(run_dir, 0),
                                              supervise.stderr_times(run_dir, 0))  # the first failure by time
        if code == 0:  # died in teardown after the work: the return value went with it
            code, text = 1, f"{text}; rank 0's return value was lost with it"
        raise SpawnError(text, code) from None
    except SignalException as exc:
        tail.stop()
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt("ddpkit.spawn: interrupted; every worker was stopped") from None
        raise SpawnError(f"ddpkit.spawn: stopped by signal {exc.sigval.name}; every worker was stopped",
                         128 + int(exc.sigval)) from None
    finally:
        tail.stop()
    if table := phase_report.summary(report_dir, run_dir):  # the per-rank table, as ddpkit launch ends with it
        print(table, file=sys.stderr, flush=True)
    return results[0]
