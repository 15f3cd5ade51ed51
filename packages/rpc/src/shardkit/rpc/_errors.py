"""Errors raised by :class:`~shardkit.rpc.DistributedOptimizer`."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["RemoteOptimizerError"]


class RemoteOptimizerError(RuntimeError):
    """One operation failed on one or more owner workers.

    Raised only after every owner has answered or timed out, so it names *every* failing worker,
    not just the first one.

    Attributes:
        operation: What was attempted (``"step(context_id=...)"``, ``"state_dict"``, ...).
        failures: Worker name -> the error that worker reported (the remote traceback text for a
            remote exception, the RPC error for a timeout or a dead worker).
        succeeded: Names of the owners on which the operation completed.
    """

    def __init__(
        self,
        operation: str,
        failures: Mapping[str, BaseException],
        succeeded: list[str],
    ) -> None:
        self.operation = operation
        self.failures: dict[str, BaseException] = dict(failures)
        self.succeeded = list(succeeded)
        total = len(self.failures) + len(self.succeeded)
        lines = [
            f"DistributedOptimizer.{operation} failed on {len(self.failures)} of {total} owner "
            f"worker(s): {sorted(self.failures)}."
        ]
        if self.succeeded:
            lines.append(
                f"It completed on {sorted(self.succeeded)}, so their parameters/state may now "
                "differ from the failing owners' (an RPC step is not transactional)."
            )
        for name in sorted(self.failures):
            err = self.failures[name]
            text = str(err).strip().replace("\n", "\n    ")
            lines.append(f"  [{name}] {type(err).__name__}: {text}")
        super().__init__("\n".join(lines))
