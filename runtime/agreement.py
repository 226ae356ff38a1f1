"""What crosses ranks besides the graph's tensors: agreement, small payloads and failure records, as bytes.

Nothing here pickles. Payloads are bytes (UTF-8 text or JSON, never objects) and travel through the c10d store
of the default group (``Channel``), or as int64 tensors in a collective (the per-call graph fingerprint, see
``zgraph.runtime.consistency``). So torch's object collectives (which pickle, and need numpy on gloo) are never
used, and nothing another rank sends can run code here.

Failure protocol (``Config.collective_timeout`` bounds every wait):

* Every zgraph call that other ranks take part in says where it is (``Channel.enter``: a label such as
  ``call 3 of step `train` ``), so a rank that times out can say which call each other rank was last in.
* A rank whose zgraph call raises records ``failed/<rank>`` (``Channel.record_failure``) and posts the failure
  into the exchange the others would meet it at, so ranks waiting there raise at once, naming it.
* Ranks blocked in a collective of the graph raise when the process group's timeout expires (or at once when
  the failing process ends); they then read the failure records and raise ``RankFailedError`` naming the
  failing rank and its error, or, where no rank recorded one, the call each rank was last in.
* After a failure in the middle of a graph's collectives the group's collectives are out of step: the group is
  marked broken and every later zgraph call on it raises at once instead of pairing mismatched collectives.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from zgraph.errors import RankFailedError, RankMismatchError
from zgraph.runtime.process_group import ProcessGroupInfo

DEFAULT_COLLECTIVE_TIMEOUT = 300.0
"""Seconds a rank waits for the others at any zgraph synchronisation point or collective (five minutes)."""

_FAILED = b"\x01"  # first byte of a posted exchange value that reports a failure instead of a payload
_SEQUENCE: dict[str, int] = {}  # per group: how many exchanges this process has made
_BROKEN: dict[str, str] = {}  # per group: why its collectives cannot be used anymore
_RECORDED: set[str] = set()  # groups in which this process has a failure record standing
_UNREACHABLE = (dist.DistError, RuntimeError)  # what a store raises when the process serving it is gone
_GRACE = 2.0  # seconds to wait for a failing rank's record once a collective has failed


class Channel:
    """The store-backed side channel of one process group; ``timeout`` (seconds) bounds every wait."""

    def __init__(self, group: ProcessGroupInfo, timeout: float = DEFAULT_COLLECTIVE_TIMEOUT):
        self.group = group
        self.timeout = timeout
        self.rank = group.rank
        self.world_size = group.world_size
        self._store = dist.PrefixStore(f"zgraph/{group.group_name}/", dist.distributed_c10d._get_default_store())

    # ------------------------------------------------------------------------------------------ positions
    def enter(self, label: str) -> None:
        """Say which zgraph call this rank is in (read by ranks that time out waiting for it)."""
        self.check_usable(label)
        self._set(label, f"pos/{self.rank}", label.encode())

    def positions(self) -> dict[int, str]:
        """The label each rank last entered (ranks that never entered one are left out)."""
        keys = [f"pos/{r}" for r in range(self.world_size)]
        return {r: self._store.get(k).decode(errors="replace") for r, k in enumerate(keys) if self._store.check([k])}

    def reachable(self) -> bool:
        """Whether the group's store answers (it is gone when the process serving it died: rank 0, or under
        torchrun the agent of the node with ``GROUP_RANK`` 0)."""
        try:
            self._store.check(["pos/0"])
        except _UNREACHABLE:
            return False
        return True

    # ------------------------------------------------------------------------------------------ exchanges
    def exchange(self, label: str, payload: bytes = b"") -> list[bytes]:
        """Every rank's ``payload``, in rank order; every rank of the group must call it at the same point.

        Raises ``RankFailedError`` when another rank failed instead (its error named), ``RankMismatchError``
        when another rank is at a different exchange, and ``RankFailedError`` after ``timeout`` seconds when a
        rank never arrives (naming where it was last).
        """
        self.enter(label)
        seq = self._next()
        self._set(label, f"x/{seq}/{self.rank}", label.encode() + b"\x00" + payload)
        keys = [f"x/{seq}/{r}" for r in range(self.world_size)]
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except dist.DistError as error:
            if not self.reachable():
                raise RankFailedError(self._unreachable_message(label, error)) from error
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise RankFailedError(self._timeout_message(label, missing)) from error
        values = self._store.multi_get(keys)
        if seq > 0:
            self._store.delete_key(f"x/{seq - 1}/{self.rank}")  # every rank has read it: all posted ``seq``
        out = []
        for r, value in enumerate(values):
            if value.startswith(_FAILED):
                raise RankFailedError(f"zgraph: rank {r} failed: {value[1:].decode(errors='replace')}")
            other, _, data = value.partition(b"\x00")
            if other != label.encode():
                raise RankMismatchError(
                    f"zgraph: the ranks stopped agreeing on what they do: rank {self.rank} is in {label}, rank {r} "
                    f"in {other.decode(errors='replace')}. Every rank must make the same zgraph calls in the same "
                    "order."
                )
            out.append(data)
        return out

    def broadcast(self, label: str, payload: bytes | None, src: int = 0) -> bytes:
        """``src``'s payload on every rank (an exchange in which the other ranks send nothing)."""
        return self.exchange(label, payload if self.rank == src and payload is not None else b"")[src]

    # ------------------------------------------------------------------------------------------- failures
    def record_failure(self, label: str, error: BaseException) -> None:
        """Record that this rank's ``label`` raised ``error``, and post the failure into the exchange the other
        ranks would meet this rank at next. Best effort: a store that cannot be reached is left alone."""
        if isinstance(error, RankFailedError):
            text = f"in {label}, after another rank's failure: {error}"
        else:
            text = f"in {label}: {type(error).__name__}: {error}"
        try:
            self._store.set(f"failed/{self.rank}", text.encode())
            _RECORDED.add(self.group.group_name or "")
            self._store.set(f"x/{self._next()}/{self.rank}", _FAILED + text.encode())
        except (dist.DistError, RuntimeError):
            pass

    def clear_failure(self) -> None:
        """A call on the group succeeded: this rank's earlier failure record (of any step) no longer applies, and
        a later failure of another rank must not be blamed on it."""
        name = self.group.group_name or ""
        if name in _RECORDED:
            self._store.delete_key(f"failed/{self.rank}")
            _RECORDED.discard(name)

    def failures(self, wait: float = 0.0) -> dict[int, str]:
        """The failure records of the other ranks, waiting up to ``wait`` seconds for a first one."""
        keys = {r: f"failed/{r}" for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + wait
        while True:
            try:
                found = {
                    r: self._store.get(k).decode(errors="replace") for r, k in keys.items() if self._store.check([k])
                }
            except _UNREACHABLE:
                return {}  # the store is gone with the process serving it: no record can be read
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def peer_failure(self, label: str, error: BaseException) -> RankFailedError:
        """The error to raise when a collective of ``label`` failed with ``error`` (a timeout, or a closed
        connection): names the rank that failed and its error, or where each rank was last. Marks the group
        broken: its collectives are out of step."""
        failures = self.failures(wait=_GRACE)
        if failures:
            named = "; ".join(f"rank {r} failed {text}" for r, text in sorted(failures.items()))
            message = f"zgraph: {label} on rank {self.rank} could not complete: {named}."
        elif not self.reachable():
            message = self._unreachable_message(label, error)
        else:
            message = (
                f"zgraph: a collective of {label} on rank {self.rank} failed ({type(error).__name__}: {error}), and "
                f"no rank recorded an error. {self._where()}"
            )
        mark_broken(self.group, message)
        return RankFailedError(message)

    def failed_running(self, label: str, error: BaseException) -> BaseException:
        """What ``error``, raised while this rank ran ``label``'s graph, becomes: where another rank failed
        first, or the error came from a collective, the ``RankFailedError`` naming that rank (``peer_failure``);
        else ``error`` itself, the group marked broken (its collectives are out of step with this rank's)."""
        if self.failures(wait=0.0) or is_collective_failure(error):
            return self.peer_failure(label, error)
        mark_broken(self.group, f"rank {self.rank} failed in {label}: {type(error).__name__}: {error}")
        return error

    def check_usable(self, label: str) -> None:
        why = _BROKEN.get(self.group.group_name or "")
        if why is not None:
            raise RankFailedError(
                f"zgraph: cannot run {label}: an earlier failure left this process group's collectives out of step "
                f"({why}). Restart every rank (torchrun restarts them all)."
            )

    # -------------------------------------------------------------------------------------------- helpers
    def _set(self, label: str, key: str, value: bytes) -> None:
        try:
            self._store.set(key, value)
        except _UNREACHABLE as error:
            raise RankFailedError(self._unreachable_message(label, error)) from error

    def _next(self) -> int:
        name = self.group.group_name or ""
        seq = _SEQUENCE.get(name, 0)
        _SEQUENCE[name] = seq + 1
        return seq

    def _timeout_message(self, label: str, missing: list[int]) -> str:
        failures = self.failures()
        if failures:
            named = "; ".join(f"rank {r} failed {text}" for r, text in sorted(failures.items()))
            return f"zgraph: rank {self.rank} waited {self.timeout:g} s in {label}: {named}."
        who = ", ".join(str(r) for r in missing)
        return (
            f"zgraph: rank {self.rank} waited {self.timeout:g} s (Config.collective_timeout) in {label} for rank(s) "
            f"{who}, which did not arrive. {self._where()}"
        )

    def _unreachable_message(self, label: str, error: BaseException) -> str:
        return (
            f"zgraph: {label} on rank {self.rank} could not complete ({type(error).__name__}: {error}), and the "
            "process group's store cannot be reached: the process serving it ended (rank 0, or under torchrun the "
            "agent of the node with GROUP_RANK 0), so no rank's failure record can be read. Restart every rank."
        )

    def _where(self) -> str:
        positions = self.positions()
        parts = [f"rank {r}: {positions.get(r, 'no zgraph call yet')}" for r in range(self.world_size)]
        return "Last zgraph call of each rank: " + "; ".join(parts) + "."


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` came from a collective (a timeout, a closed connection) rather than this rank's own
    computation."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        mark in text for mark in ("gloo", "Timed out", "Connection closed", "NCCL", "pair closure")
    )


def mark_broken(group: ProcessGroupInfo, why: str) -> None:
    """Every later zgraph call on ``group`` raises (see ``Channel.check_usable``)."""
    _BROKEN.setdefault(group.group_name or "", why)


def world_channel(timeout: float = DEFAULT_COLLECTIVE_TIMEOUT) -> Channel | None:
    """The channel of the default process group, or None in a single process (nothing to agree with)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    info = ProcessGroupInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), group_name=world.group_name, backend=None
    )
    return Channel(info, timeout)
