"""weightsync in Ray actors: an :class:`~weightsync.Orchestrator` that replaces a dropped generator
actor through Ray's own API.

A trainer actor holds the :class:`~weightsync.Publisher`; generator actors hold a
:class:`~weightsync.Subscriber` each, with the publisher's address handed to them through Ray (an
actor method returns ``pub.address``). When the publisher drops a generator (dead, or slow when the
policy says so), :meth:`RayOrchestrator.replace` kills that actor if it still runs
(``ray.kill(..., no_restart=True)``), starts a new one from the actor class it was given and,
with ``ready=``, waits until that actor says it joined. Weights never travel through Ray: only the
address, member ids and whatever small values the application's own methods return.

``ray`` is imported when an orchestrator is made, never by ``import weightsync``. Install it with
the ``ray`` extra (``pip install weightsync[ray]``). rl_examples/ray_generators.py is a whole
run: a generator actor killed with ``ray.kill`` and replaced while the trainer keeps putting.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

from weightsync.membership.membership import MemberInfo

log = logging.getLogger("weightsync.orchestrator")

__all__ = ["RayOrchestrator"]

_FIELD = re.compile(r"\{(member|new|n|reason)\}")
_NAME_RELEASE_POLL = 0.1  # seconds between looks at a killed actor's name (Ray frees it once dead)


def _import_ray() -> Any:
    try:
        import ray  # noqa: PLC0415 - optional dependency, imported where it is used
    except ImportError as err:
        raise ImportError("RayOrchestrator needs Ray: pip install 'weightsync[ray]'") from err
    return ray


class RayOrchestrator:
    """Replaces dropped members with new actors of ``actor_class`` (a ``@ray.remote`` class).

    Args:
        actor_class: the generator actor class, as ``@ray.remote`` made it.
        *args, **kwargs: its constructor's arguments. In every ``str`` among them ``{member}``
            (the dropped member's id, as for :class:`~weightsync.LocalProcessOrchestrator`),
            ``{new}`` (the new member's id), ``{n}`` (1, 2, ...) and ``{reason}`` (why the old one
            was dropped) are filled in; other braces stay as written.
        member_id: the new member's id, with the same fields (but ``{new}``); ``"{member}"`` reuses
            the dropped id (the analyzer reads it as a new incarnation). Default ``"repl-{n}"``.
        name: the new actor's Ray name (same fields; default ``"{new}"``: its member id), so an
            application finds it with ``ray.get_actor``; ``None`` leaves it unnamed.
        namespace: the Ray namespace of the names (default: the job's).
        options: more ``actor_class.options(...)`` (``num_cpus``, ``resources``, ...).
        ready: a method of the new actor to call and wait for (``"ready"``: it returns once its
            subscriber joined); ``None`` returns as soon as the actor was created.
        ready_timeout: how long ``replace`` waits for ``ready`` and for a reused name to be freed.
        kill_old: kill the dropped member's actor first when it still runs (a slow member does).
            Only a handle this orchestrator holds is ever killed: an actor it started, or one the
            application handed it in ``actors=``. A member id is never looked up as a Ray name (a
            member that joined as ``"trainer"`` and went silent would get the application's own
            actor of that name killed). Default True.
        actors: the generator actors started by the application, by member id: the ones
            ``kill_old`` may kill (:meth:`adopt` adds more later).

    ``started`` lists ``(dropped member, new member id, actor handle)``; :meth:`aclose` kills the
    actors this orchestrator started (not the application's own) and returns once Ray has the
    named ones dead.
    """

    def __init__(self, actor_class: Any, *args: Any, member_id: str = "repl-{n}", name: str | None = "{new}",
                 namespace: str | None = None, options: Mapping[str, Any] | None = None, ready: str | None = "ready",
                 ready_timeout: float = 120.0, kill_old: bool = True, actors: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self._ray = _import_ray()
        if not hasattr(actor_class, "options") or not hasattr(actor_class, "remote"):
            raise TypeError(f"actor_class must be a @ray.remote class, got {actor_class!r}")
        if ready_timeout <= 0:
            raise ValueError(f"ready_timeout must be > 0, got {ready_timeout}")
        if "{new}" in member_id:
            raise ValueError(f"member_id makes the new id: it may use {{member}}, {{n}} and {{reason}}, "
                             f"got {member_id!r}")
        self.actor_class, self.args, self.kwargs = actor_class, args, kwargs
        self.member_id, self.name, self.namespace = member_id, name, namespace
        self.options = dict(options or {})
        self.ready, self.ready_timeout, self.kill_old = ready, ready_timeout, kill_old
        self.actors: dict[str, Any] = dict(actors or {})
        self.started: list[tuple[MemberInfo, str, Any]] = []
        self._names: list[str] = []  # of the actors it started and named

    async def __aenter__(self) -> RayOrchestrator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def replace(self, member: MemberInfo) -> None:
        """Kill the dropped member's actor (``kill_old``), start its replacement, wait for ``ready``."""
        ray = self._ray
        n = len(self.started) + 1
        fields = {"member": member.member_id, "new": "{new}", "n": str(n), "reason": member.reason}
        new_id = _fill(self.member_id, fields)
        fields["new"] = new_id
        name = _fill(self.name, fields) if self.name is not None else None
        if self.kill_old:
            old = self._find(member.member_id)
            if old is not None:
                ray.kill(old, no_restart=True)
        if name is not None:
            await self._name_released(name)
        args = [_fill_any(a, fields) for a in self.args]
        kwargs = {k: _fill_any(v, fields) for k, v in self.kwargs.items()}
        options = dict(self.options)
        if name is not None:
            options["name"] = name
        if self.namespace is not None:
            options["namespace"] = self.namespace
        handle = self.actor_class.options(**options).remote(*args, **kwargs)
        self.started.append((member, new_id, handle))
        if name is not None:
            self._names.append(name)
        self.actors[new_id] = handle
        log.info("started Ray actor %s to replace %s (%s)", name or new_id, member.member_id, member.reason)
        if self.ready is not None:
            ref = getattr(handle, self.ready).remote()
            try:  # awaited on this (the replacement thread's) loop: no blocking ray.get in an actor
                await asyncio.wait_for(ref, timeout=self.ready_timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"Ray actor {name or new_id} did not answer {self.ready}() within "
                                   f"{self.ready_timeout:g} s") from None

    def adopt(self, actors: Mapping[str, Any]) -> None:
        """Hand over the application's generator actors (member id -> handle): ``kill_old`` may kill
        these when their member is dropped, and no others but the ones it started."""
        self.actors.update(actors)

    def _find(self, member_id: str) -> Any | None:
        """The handle this orchestrator holds for ``member_id``, or None: never a lookup by name."""
        return self.actors.pop(member_id, None)

    async def _name_released(self, name: str) -> None:
        """A reused name is free once Ray has the old actor dead; wait for that, bounded."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                self._ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray actor name {name!r} still taken after {self.ready_timeout:g} s")
            await asyncio.sleep(_NAME_RELEASE_POLL)  # polling Ray's registry, bounded by the deadline

    async def aclose(self) -> None:
        """Kill the actors this orchestrator started; returns once Ray has the named ones dead
        (``ray.kill`` only asks: a call made right after it could still be served), bounded by
        ``ready_timeout``."""
        for _member, _new_id, handle in self.started:
            try:
                self._ray.kill(handle, no_restart=True)
            except Exception as err:  # noqa: BLE001 - one gone already must not stop the others
                log.debug("could not kill a replacement actor: %s", err)
        for name in self._names:
            try:
                await self._name_released(name)
            except TimeoutError as err:
                log.warning("%s", err)


def _fill(template: str, fields: Mapping[str, str]) -> str:
    return _FIELD.sub(lambda m: fields[m.group(1)], template)


def _fill_any(value: Any, fields: Mapping[str, str]) -> Any:
    return _fill(value, fields) if isinstance(value, str) else value
