"""Every tensor ddpkit hands to a collective is on ``state.device``, checked on CPU: ``device_guard.py OUT``.

Why a plain ``tensor.device == state.device`` check cannot work here: on CPU every tensor is on the group's
device, made with ``device=state.device`` or not. What breaks on NCCL is a tensor made *without* a device (or
moved with ``.cpu()``): torch puts it on the CPU while the group's device is a GPU. So the guard tracks where
each tensor *would* be on a GPU run: a :class:`Placement` mode (a ``TorchFunctionMode``, active from right
after ``init()``) tags every tensor torch makes: ``"cpu"`` for a factory call without ``device=`` (and for
``frombuffer`` and other untracked makers), for ``.cpu()`` and ``.to("cpu")``; ``"group"`` for ``device=`` a
``torch.device`` (``state.device``, ``x.device``) and ``.to(that)``; every other op inherits the tag of its
first tensor argument, in-place ops keep their target's. The collective entry points of ``torch.distributed``
are wrapped (ddpkit's modules call them as ``dist.<name>``, attributes of that module): a call made *by
ddpkit* (its direct caller lives in the ``ddpkit`` package; torch's own internal collectives are its business)
with a tensor tagged ``"cpu"`` is recorded as a violation. Nothing in the library is patched.

The worker runs control (broadcast, gather_object, any_rank, all_ranks, barrier), collectives (reduce,
gather), a step loader with count=, a stream loader (training, evaluation, ``state_dict``) and a Checkpointer
save and restore with the stream loader, in the launch's mode; rank 0 writes OUT/guard-<mode>.json: the
violations and the ddpkit functions on the stack of each guarded call (so the test knows each area was exercised).

Example::

    ddpkit launch --nproc-per-node 2 tests/workers/device_guard.py /tmp/out
"""
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

CPU, GROUP = "cpu", "group"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list")


def tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def _target(device):
    """Where a ``device=`` argument puts a tensor on a GPU run (None: not a device)."""
    if isinstance(device, str):
        return CPU if device.startswith("cpu") else GROUP
    if isinstance(device, (torch.device, int)) and not isinstance(device, bool):
        return GROUP
    return None


class Placement(TorchFunctionMode):
    """Tags each tensor with where a GPU run would hold it (see the module docstring).

    >>> with Placement() as p:
    ...     flag, good = torch.tensor([1]), torch.zeros(1, device=torch.device("cpu"))
    ...     moved, back = flag.to(good.device), good.cpu()
    >>> [p.where(t) for t in (flag, good, moved, back, good + 1)]
    ['cpu', 'group', 'group', 'cpu', 'group']
    """

    def __init__(self):
        super().__init__()
        self.tags = WeakIdKeyDictionary()

    def where(self, tensor):
        return self.tags.get(tensor, CPU)  # untracked makers (frombuffer, from_numpy) give CPU tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if "out" in kwargs or (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") \
                or name == "__setitem__":
            return out  # in place: the target stays where it is
        tag = self._placement(name, args, kwargs)
        if tag == CPU and name in ("cpu", "to") and args and out is args[0]:
            out = out.view_as(out)  # "moved" to the CPU: a new tensor, the original keeps its own tag
        for t in tensors(out):
            self.tags[t] = tag
        return out

    def _placement(self, name, args, kwargs):
        if name == "cpu":
            return CPU
        if name == "cuda":
            return GROUP
        if name == "to":
            for a in (*args[1:], kwargs.get("device")):
                if isinstance(a, torch.Tensor):
                    return self.where(a)
                if _target(a) is not None:
                    return _target(a)
        elif kwargs.get("device") is not None:
            return _target(kwargs["device"]) or GROUP
        inputs = tensors(args)
        return self.where(inputs[0]) if inputs else CPU  # a factory without device=: the default device


class Guard:
    """Wraps torch.distributed's collectives: ddpkit's calls with a tensor the placement calls CPU are recorded."""

    def __init__(self, placement):
        self.placement, self.violations, self.callers = placement, [], set()
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, collective in self.originals.items():
            setattr(dist, name, self._wrap(name, collective))

    def remove(self):
        for name, collective in self.originals.items():
            setattr(dist, name, collective)

    def _wrap(self, name, collective):
        @functools.wraps(collective)
        def checked(*args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("ddpkit"):
                where = f"{module}.{caller.f_code.co_name}"
                frame = caller
                while frame is not None:  # every ddpkit function on the way (streams -> control.agree)
                    if frame.f_globals.get("__name__", "").startswith("ddpkit"):
                        self.callers.add(f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}")
                    frame = frame.f_back
                for t in tensors(args) + tensors(kwargs):
                    if self.placement.where(t) != GROUP:
                        self.violations.append(f"{where} handed dist.{name} a tensor made on the CPU "
                                               f"(shape {list(t.shape)}, {t.dtype}), not on state.device")
            return collective(*args, **kwargs)
        return checked


def main():
    from torch import nn
    from torch.utils.data import IterableDataset

    import ddpkit

    out = sys.argv[1]
    torch.set_num_threads(1)
    state = ddpkit.init(seed=0)
    placement = Placement()
    guard = Guard(placement)
    rank = state.rank

    class Stream(IterableDataset):
        """Rank 1's share runs dry first in evaluation (19 samples: 10 and 9), so "empty" batches are agreed."""

        def __iter__(self):
            for i in range(19):
                x = torch.full((4,), float(i))
                yield x, x.sum(0, keepdim=True)

    with placement:
        ddpkit.broadcast({"lr": 0.1} if rank == 0 else None)
        ddpkit.broadcast(torch.arange(3.0) if rank == 0 else None)
        ddpkit.gather_object({"rank": rank})
        ddpkit.any_rank(rank == 1), ddpkit.all_ranks(True)
        ddpkit.barrier()
        ddpkit.reduce(rank), ddpkit.reduce(0.5, "mean", count=2), ddpkit.reduce(torch.tensor([1.0, rank]), "max")
        ddpkit.gather(torch.arange(3) + rank)

        torch.manual_seed(0)
        model = ddpkit.prepare_model(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ckpt = ddpkit.Checkpointer(os.path.join(out, f"ckpt-{state.mode}"))
        loader = ddpkit.data_loader(Stream(), batch_size=2)
        step = ckpt.restore(model=model, optimizer=opt, loader=loader)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == 2:
                ckpt.save(step, model=model, optimizer=opt, loader=loader)
        with torch.no_grad():
            for x, _ in ddpkit.data_loader(Stream(), batch_size=2, train=False):
                model(x)
        again = ddpkit.data_loader(Stream(), batch_size=2)
        restored = ckpt.restore(ckpt.latest(), model=model, optimizer=opt, loader=again)
        again.state_dict()
        steps = ddpkit.data_loader(list(range(6)), global_batch_size=4, micro_batch_size=1,
                                   count=lambda batch: len(batch))  # the step's count: one all-reduce
        for step in steps:
            for x in step.micro_batches(model):
                step.backward(model(x.float().unsqueeze(1).expand(-1, 4)).sum())
        if state.mode == "ddp":  # the replicas' checks, a difference found and healed (issue 47)
            torch.manual_seed(0)
            twin = ddpkit.prepare_model(nn.Linear(4, 1), check_sync_every=1, heal="rank0")
            twin_opt = torch.optim.Adam(twin.parameters())  # its step count is a CPU tensor: healed through the device
            for i in range(3):
                twin(torch.ones(2, 4)).sum().backward()
                twin_opt.step()
                twin_opt.zero_grad()
                if i == 1 and rank == 1:
                    with torch.no_grad():
                        ddpkit.unwrap(twin).weight.add_(1.0)
    everyone = ddpkit.gather_object({"violations": guard.violations, "callers": sorted(guard.callers)})
    if state.is_main:
        with open(os.path.join(out, f"guard-{state.mode}.json"), "w") as f:
            json.dump({"ranks": everyone, "restored": restored}, f)


if __name__ == "__main__":
    main()
