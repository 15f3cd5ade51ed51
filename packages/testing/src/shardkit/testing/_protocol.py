"""Messages exchanged between the pytest process and the rank processes of a world.

Every message is a small picklable tuple. The pytest process sends :class:`RunJob` and
:class:`Shutdown`; a rank answers :class:`Ready` once its process group is up, then one
:class:`JobResult` per job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["JobResult", "Ready", "RunJob", "Shutdown"]


@dataclass(frozen=True)
class RunJob:
    """Run one test body on a rank."""

    job_id: int
    """Increasing id, echoed in the result so a late answer is never taken for a new one."""

    path: str
    """File path of the test module (rank processes import it by path)."""

    qualname: str
    """Qualified name of the test function in that module (``Class.method`` supported)."""

    kwargs_blob: bytes
    """The pickled keyword arguments pytest resolved for the test (fixtures, parameters)."""

    sys_path: tuple[str, ...]
    """The pytest process's ``sys.path``, so conftest-relative imports resolve on the ranks."""


@dataclass(frozen=True)
class Shutdown:
    """Tear the process group down and exit."""


@dataclass(frozen=True)
class Ready:
    """Sent once by a rank after ``init_process_group`` succeeded (or failed)."""

    rank: int
    """The rank that is ready."""

    pid: int
    """Its process id."""

    error: str | None = None
    """The formatted traceback when initialisation failed."""


@dataclass(frozen=True)
class JobResult:
    """Outcome of one :class:`RunJob` on one rank."""

    job_id: int
    """The id of the job this answers."""

    rank: int
    """The rank that ran it."""

    outcome: str
    """``"passed"``, ``"failed"`` or ``"skipped"``."""

    detail: str = ""
    """Traceback for a failure, reason for a skip."""

    healthy: bool = True
    """False when the default process group is unusable after the test (the world is then
    discarded rather than reused)."""

    extra: Any = None
    """Reserved for future use; always None today."""
