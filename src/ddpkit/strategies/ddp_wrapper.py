"""DistributedDataParallel as mode ``ddp`` puts it around the model (:class:`DDP`): the plain module's state
dict, unused parameters named at the first backward, optional cross-rank weight checks, and the reducers
released at shutdown.

Example::

    model = DDP(net, device_ids=None, check_sync_every=100)   # after init_process_group
    model.state_dict().keys() == net.state_dict().keys()      # no "module." prefix
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from ddpkit.core import process
from ddpkit.strategies.consistency import FirstBackwardCheck, check_in_sync, unused_later
from ddpkit.strategies.forwarding import PlainStateDict, user_method
from ddpkit.strategies.redirect import through_forward
from ddpkit.strategies.replicas import ReplicaError, Replicas

# Every DDP model this interpreter made, released at shutdown. Not run state for core.process to reset: it is a
# registry of torch objects in this heap, and a worker forked from a notebook kernel holds copies of the
# kernel's DDP models (and their reducers, which hold the kernel's process group) that it must release too.
_LIVE_DDP: weakref.WeakSet[DDP] = weakref.WeakSet()


def _release_reducers() -> None:
    """At shutdown, free each DDP's reducer (which holds the process group) while Python is whole.

    Left to interpreter teardown, the gloo process group's destructor runs late and now and then hangs or
    aborts (SIGABRT) the process after training finished; a user's own ``destroy_process_group()`` does not
    help while a DDP model still references the group.
    """
    for model in list(_LIVE_DDP):
        for name in ("logger", "reducer"):
            model.__dict__.pop(name, None)
    _LIVE_DDP.clear()
    gc.collect()


def live_models() -> list[DDP]:
    """The DDP models this process made and still holds (``ddpkit.data_loader(..., batch_count=)`` weighs their
    gradients)."""
    return list(_LIVE_DDP)


class DDP(PlainStateDict, DistributedDataParallel):
    """torch's DistributedDataParallel whose state dict is the plain module's.

    It also names, during the first backward, any parameter that got no gradient (instead of DDP's late
    "Expected to have finished reduction" error), compares parameter checksums across ranks before the first
    training step (one all_gather of four numbers per tensor, once) and then compares the replicas' fingerprints
    every few training steps (:class:`~ddpkit.strategies.replicas.Replicas`: ``check_sync_every='auto'``, K or
    0; ``heal=True`` copies the majority's weights to a rank that left it).

    A training step is a forward in training mode with gradients enabled, outside a join (:meth:`join`,
    :func:`ddpkit.join` or torch's own ``Join([model])``): evaluation forwards (``model.eval()`` or
    ``torch.no_grad()``) and the uneven steps of a join differ in number between ranks by design, so a check
    there would meet no peer (one rank in the checksums' all_gather, another in DDP's all-reduce or already
    past its loop).
    """

    refuses_layer_writes = True  # ForwardsAttributes: the reducer knows the layers of prepare time only

    def __init__(self, module: nn.Module, *args: Any, check_sync_every: int | str = "auto",
                 heal: bool | str = False, **kwargs: Any):
        super().__init__(module, *args, **kwargs)
        self.accept_plain_keys()  # (a part of a container: the container's checkpoint loads at any N)
        # every time, not only for the first DDP: a worker forked from a kernel that held DDP models starts with
        # fresh shutdown hooks (process.reset) but the kernel's _LIVE_DDP; on_shutdown keeps one copy
        process.on_shutdown(_release_reducers, always=True)
        _LIVE_DDP.add(self)
        # the parameters: buffers are rank 0's at every forward (broadcast_buffers) or per rank on purpose (without
        # it: running statistics of any norm layer, a script's own counters), never a sign of a desync
        self._replicas = Replicas(module, self.process_group, every=check_sync_every, heal=heal,
                                  ignore=frozenset(self.parameters_to_ignore))
        self._training_steps = 0  # counted alike on every rank: see the class docstring
        # forwards with gradients through the wrapper in any mode (a model trained in eval mode, as from_pretrained
        # returns it, is averaged by DDP all the same): none by the first optimizer step, and its gradients came
        # from elsewhere
        self._forwards = 0
        owner = weakref.ref(self)  # (a weak one: the replicas outlive no wrapper through it)
        self._replicas.forwards = lambda: getattr(owner(), "_forwards", 1)
        self._joined = False  # inside a join: from join_hook() (every Join asks for it) to its post-hook
        # static_graph: DDP itself finds, in the first iteration, the parameters that never get a gradient
        if not (kwargs.get("find_unused_parameters", False) or kwargs.get("static_graph", False)):
            self._first_backward = FirstBackwardCheck(module)
        # a method of the user's class called this way runs on the local module (set-up, inference); those named
        # in prepare_model(forward_methods=...) run as DDP's forward in a training step (redirect.py)
        self.forward_methods: frozenset[str] = frozenset()
        self.start_forwarding()

    def _forwarded(self, inner: nn.Module, name: str, value: Any) -> Any:
        named = name in self.__dict__.get("forward_methods", ())
        return through_forward(self, inner, value) if named and user_method(inner, name, value) else value

    def __getstate__(self) -> dict[str, Any]:
        # copy / pickle: forwarding starts again only after DDP's __setstate__ has set its own attributes
        # (logger, reducer), which would otherwise land in the user's module when it has such a name
        state = dict(super().__getstate__())
        state.pop("_forwarding", None)
        state.pop("_replicas", None)  # it holds the process group, which torch's DDP leaves out too
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # a copy (an EMA model, copy.deepcopy) is no replica the ranks train in step: not checked
        self.__dict__["_replicas"] = Replicas(self.module, self.process_group, every=0)
        self.__dict__["_forwarding"] = True

    # Not traced by torch.compile (only this frame: the module inside is compiled as usual, with DDP's bucket
    # splitting): the checks and the heartbeat are Python side effects that would break the graph every step.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any):
        # a Join(enable=False) that was left asks nothing of the ranks: checks run there
        joined = self._joined and self._join_config.enable
        self._forwards += torch.is_grad_enabled()  # (a no-grad validation forward makes no gradient)
        if self.training and torch.is_grad_enabled() and not joined:
            if self._training_steps == 0:  # always, once: ranks that start different never meet again
                self._check_start()
            else:  # inline, not a call: dynamo would trace a callee of this frame (see Replicas.check)
                replicas = self._replicas
                replicas.seen = self._training_steps
                if replicas.every and self._training_steps >= replicas.next and replicas.tensors:
                    try:
                        replicas.check(self._training_steps)
                    except ReplicaError:
                        self._reduced_before()  # (parted by a step DDP never reduced: that said instead)
                        raise
            self._training_steps += 1
        process.heartbeat()
        if (stamp := process.current().on_ddp_forward) is not None:
            stamp(self, True)  # the phase report: DDP's own part of the forward (the buffer broadcast) waits
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as exc:  # (DDP names unused parameters by index only: said by name)
            said = unused_later(self.module, set(self.parameters_to_ignore), str(exc))
            if said is None:
                raise
            raise RuntimeError(said) from exc

    def _reduced_before(self) -> None:
        """Raise what DDP would at this forward when its reducer never finished the step before (parameters that
        step left without a gradient): the replicas parted there because those gradients were never averaged,
        which the replica check found first. Only on the way to an error: DDP asks its reducer at every forward."""
        try:
            self.reducer._rebuild_buckets()
        except RuntimeError as exc:
            said = unused_later(self.module, set(self.parameters_to_ignore), str(exc))
            if said is not None:
                raise RuntimeError(said) from exc

    # Not traced either (torch's own frame here is not: a traced one would be a new compiled frame)
    @torch.compiler.disable(recursive=False)
    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any):
        if (stamp := process.current().on_ddp_forward) is not None:
            stamp(self, False)  # the phase report: the module's own forward, compute
        return super()._run_ddp_forward(*inputs, **kwargs)

    def join(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
        """torch's ``join`` (what :func:`ddpkit.join` enters), with the sync checks paused inside."""
        return self._without_checks(super().join(*args, **kwargs))

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's hook, which every ``Join`` (torch's own ``Join([model])`` too) asks for as it is made: the
        checks pause from here until the hook's post-hook, which every rank runs once all have joined."""
        if self._training_steps == 0 and self.training:  # a loop that trains inside the join from its start
            self._check_start()
            self._training_steps += 1
        self._joined = True
        return _ResumeChecks(super().join_hook(**kwargs), self)

    def _check_start(self) -> None:
        """Every rank holds rank 0's weights (what DDP gave them at the wrap) but those it is told to ignore."""
        check_in_sync(self.module, self.process_group, first_step=True, buffers=not self.broadcast_buffers,
                      ignore=self.parameters_to_ignore)

    @contextlib.contextmanager
    def _without_checks(self, context: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        try:
            with context:
                yield
        finally:  # also when the loop raised, and torch's Join skipped the post-hook
            self._joined = False


class _ResumeChecks(JoinHook):
    """DDP's join hook, resuming ``model``'s sync checks in its post-hook (the join ended on every rank)."""

    def __init__(self, hook: JoinHook, model: DDP):
        self.hook, self.model = hook, model

    def main_hook(self) -> None:
        self.hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.hook.post_hook(is_last_joiner)
        self.model._joined = False

