"""What ``ddpkit verify`` prints for a result: the PASS line, the FAIL lines, and how long the runs trained."""

from __future__ import annotations


def run_length(result: dict) -> str:
    """How long both runs trained, from what they recorded, and what stopped them.

    >>> run_length({"steps_taken": 2, "cap": None})
    '2 steps (the script ended by itself)'
    >>> run_length({"steps_taken": 0, "cap": "batches", "batches": 5})
    '5 batches (no optimizer.step() seen: the training loaders were capped at 5 batches)'
    """
    taken = result.get("steps_taken", result.get("steps"))
    if result.get("cap") == "batches":
        return f"{result['batches']} batches (no optimizer.step() seen: the training loaders were capped at " \
               f"{result['batches']} batches)"
    plural = "" if taken == 1 else "s"
    if result.get("cap") == "steps":
        return f"{taken} step{plural} (stopped by the step cap)"
    return f"{taken} step{plural} (the script ended by itself)"


def pass_line(result: dict, nproc: int, mode: str) -> str:
    """The PASS line: the steps actually taken and the cap that applied, the tensors and their largest diff.

    >>> pass_line({"steps_taken": 5, "cap": "steps", "tensors": 9, "max_abs_diff": 1.2345e-7}, 2, "ddp")
    'PASS: 2 processes match 1 process after 5 steps (stopped by the step cap; 9 tensors, max abs diff 1.23e-07)'
    """
    shown = "" if mode == "ddp" else f" ({mode})"
    return (f"PASS: {nproc} processes{shown} match 1 process after {run_length(result)[:-1]}; "
            f"{result['tensors']} tensors, max abs diff {result['max_abs_diff']:.3g})")


def fail_line(result: dict, steps: int, atol: float, rtol: float) -> str:
    """The FAIL lines of a finite difference: the first tensor, its diff (3 significant digits), the cause.

    >>> fail_line({"first_diverging": "w", "first_max_abs_diff": 0.000051234, "cause": "a cause"}, 5, 1e-5, 1e-4)
    "FAIL: 'w' differs after 5 steps (max abs diff 5.12e-05; atol 1e-05, rtol 0.0001)\\nlikely cause: a cause"
    """
    diff = result.get("first_max_abs_diff", result.get("max_abs_diff"))
    shown = "n/a" if diff is None else f"{diff:.3g}"
    taken = result.get("steps_taken", steps)
    line = (f"FAIL: {result['first_diverging']!r} differs after {taken} step{'' if taken == 1 else 's'} "
            f"(max abs diff {shown}; {result.get('reason', f'atol {atol:g}, rtol {rtol:g}')})")
    return line + (f"\nlikely cause: {result['cause']}" if result.get("cause") else "")
