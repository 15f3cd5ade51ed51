"""The one private torch API this package relies on, isolated here and pinned by a test.

* ``torch.utils._python_dispatch.TorchDispatchMode``: a mode that sees every operator the
  dispatcher runs on this thread (from Python or C++, in a backward pass too), below autograd;
  torch's own debugging tools (``FlopCounterMode``, the fake-tensor and memory-tracking modes)
  are built on it. There is no public equivalent that attributes an allocation to the code that
  asked for it: ``torch.profiler``'s memory events are public but name only the operator.
  ``tests/test_allocations.py::test_dispatch_mode_pin`` pins what :class:`LargeAllocations`
  relies on (it sees factory ops called from Python and from hooks in backward, not the ops an
  operator runs inside its own implementation).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode"]
