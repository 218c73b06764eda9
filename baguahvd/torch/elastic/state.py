"""``TorchState``: a model, an optimizer, samplers and plain values that survive restarts."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from baguahvd.runtime.runtime import runtime
from baguahvd.torch.averaging import average_tree, keeps_replicas
from baguahvd.torch.elastic.base import HostUpdateResult, ObjectState
from baguahvd.torch.elastic.copies import copy_state
from baguahvd.torch.elastic.sampler import ElasticSampler
from baguahvd.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

logger = logging.getLogger(__name__)

__all__ = [
    "HostUpdateResult",
    "ModelStateHandler",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "StateHandler",
    "TorchState",
    "get_handler_registry",
    "set_handler_registry",
]


class StateHandler:
    """Saves, restores and syncs one value of a :class:`TorchState`.

    Subclass it (and register the subclass with :func:`set_handler_registry`) for values of
    other types. :meth:`saved` and :meth:`load` let commits persist to the elastic folder.

    Args:
        value: the object handled.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        """Keeps a copy of the value's state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Puts the saved copy back into the value."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes the value equal to rank 0's on every rank. Collective."""
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """Handles ``value`` from now on, and saves it."""
        self.value = value
        self.save()

    def saved(self) -> Any:
        """The saved copy, as persisted by a commit. A commit's write runs in the
        background while training goes on, so :meth:`save` must make a new copy rather
        than change the previous one in place."""
        raise TypeError(
            f"{type(self).__name__} cannot persist commits; implement saved() and load()"
        )

    def load(self, saved: Any) -> None:
        """Makes ``saved`` (from :meth:`saved`) the saved copy and restores it."""
        raise TypeError(
            f"{type(self).__name__} cannot persist commits; implement saved() and load()"
        )


class _StateDictHandler(StateHandler):
    """A value with ``state_dict()``/``load_state_dict()``; saves a deep copy."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.spare: Any = None
        """An earlier saved copy that nothing reads any more, whose tensors the next
        :meth:`save` copies into (see :mod:`~baguahvd.torch.elastic.copies`); set by
        :class:`TorchState`, taken by the save."""
        self.save()

    def save(self) -> None:
        spare, self.spare = self.spare, None
        self._saved = copy_state(self.value.state_dict(), spare)

    def restore(self) -> None:
        # A deep copy, so that later steps cannot write through into the saved state.
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def saved(self) -> Any:
        return self._saved

    def load(self, saved: Any) -> None:
        self._saved = saved
        self.restore()


class ModelStateHandler(_StateDictHandler):
    """An ``nn.Module``: parameters and buffers, synced with ``broadcast_parameters``."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer``: state and hyperparameters, synced with
    ``broadcast_optimizer_state``."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """An :class:`ElasticSampler`: epoch and progress, synced with ``broadcast_object``."""

    def sync(self) -> None:
        self.value.load_state_dict(
            broadcast_object(self.value.state_dict(), 0, name="elastic.sampler")
        )


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The (type, handler class) pairs that :class:`TorchState` checks, in order."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replaces the (type, handler class) pairs that later :class:`TorchState`\\ s use."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """Horovod's elastic state for PyTorch training.

    Every keyword becomes an attribute. Modules, optimizers and :class:`ElasticSampler`\\ s
    are saved as deep copies of their ``state_dict()`` and synced with the matching
    broadcast; other values are deep-copied and synced with ``broadcast_object``. Assigning
    a new module/optimizer/sampler to an attribute (``state.model = other``) handles and
    saves the new one.

    ``commit()`` saves in memory and, under ``baguahvdrun --elastic``, persists to the
    elastic folder, so that a restarted job resumes from it: the copy is taken when
    ``commit()`` is called (on the tensors' device; CPU tensors into the memory of an
    earlier copy that no write reads any more, see :mod:`~baguahvd.torch.elastic.copies`,
    which keeps at most one spare copy of the state) and written on a background thread
    while training goes on, CUDA tensors through pinned host buffers; a commit made while a
    write is in flight is written next, unless a newer one supersedes it (see
    :mod:`baguahvd.torch.elastic.writer`).

    Args:
        model: the model (or None).
        optimizer: the optimizer, plain or distributed (or None).
        **kwargs: further values: samplers, more models, counters such as ``epoch``.
    """

    _handlers: dict[str, StateHandler]

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        self._replaced: list[tuple[int, dict[str, Any]]] = []
        """Saved copies replaced by a save, with the commit they belong to (see :meth:`save`)."""
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(
            bcast_object=broadcast_object,
            get_rank=runtime.rank,
            allgather_object=allgather_object,
            **plain,
        )

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        # Weights that an algorithm averages in the background (async) would be copied
        # half-updated: stop the averaging for the copy. Collective, like commit().
        paused = [impl for impl in self._background_algorithms() if impl.running]
        for impl in paused:
            impl.abort()
        try:
            spares = self._free_copies()
            replaced: dict[str, Any] = {}
            for name, handler in self._handlers.items():
                if isinstance(handler, _StateDictHandler):
                    replaced[name] = handler.saved()
                    handler.spare = spares.get(name)
                handler.save()
            # The copies just replaced belong to the last commit: free once the writer no
            # longer holds it (at once where it never had it).
            self._replaced.append((self._commits, replaced))
            super().save()
        finally:
            for impl in paused:
                impl.resume()

    def _free_copies(self) -> dict[str, Any]:
        """The newest replaced saved copies (per handler) of a commit that no write reads
        any more; older ones are let go, so at most one spare per handler is kept."""
        writer = self._writer
        held = writer.holds() if writer is not None else frozenset()
        free = [copies for number, copies in self._replaced if number not in held]
        self._replaced = [(number, c) for number, c in self._replaced if number in held]
        return free[-1] if free else {}

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def _background_algorithms(self) -> list[Any]:
        found = []
        for handler in self._handlers.values():
            impl = getattr(handler.value, "algorithm_impl", None)
            if impl is not None and hasattr(impl, "running"):
                found.append(impl)
        return found

    def _average_replicas(self) -> None:
        # Every rank trains its own replica under a weight-averaging algorithm: a commit of
        # rank 0's would drop the others' progress, so commit their average instead.
        if not any(keeps_replicas(h.value) for h in self._handlers.values()):
            return
        for name, handler in self._handlers.items():
            if isinstance(handler, (ModelStateHandler, OptimizerStateHandler)):
                handler._saved = average_tree(handler._saved, f"elastic.average.{name}")

    def reset(self) -> None:
        """Re-splits the samplers over the current ranks."""
        for handler in self._handlers.values():
            if isinstance(handler.value, ElasticSampler):
                handler.value.reset()

    def _payload(self) -> Any:
        payload = super()._payload()
        payload["handlers"] = {name: h.saved() for name, h in self._handlers.items()}
        return payload

    def _load_payload(self, payload: Any) -> None:
        saved_handlers = payload["handlers"]
        if saved_handlers.keys() != self._handlers.keys():
            logger.warning(
                "the commit holds %s but this state has %s; loading the shared ones",
                sorted(saved_handlers),
                sorted(self._handlers),
            )
        for name, saved in saved_handlers.items():
            if name in self._handlers:
                self._handlers[name].load(saved)
        super()._load_payload(payload)
