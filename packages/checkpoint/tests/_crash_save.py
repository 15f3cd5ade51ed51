"""Run by test_save_load in a subprocess: save a job's state after STEPS steps, dying at a step.

Usage: python _crash_save.py PATH STEPS CRASH_AT
Trains the test model STEPS steps (one process, no process group), then saves its state with
``shardkit.checkpoint.save``; with CRASH_AT other than "none" the process exits with status 17
(no cleanup, no atexit) at that point of the save.
"""

from __future__ import annotations

import os
import sys

import shardkit.checkpoint._commit as _commit
from _ckpt_testkit import model_and_optim, state_of, train
from shardkit.checkpoint import save


def main() -> None:
    path, steps, crash_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model, opt = model_and_optim()
    train(model, opt, steps)
    state = state_of(model, opt)
    state["step"] = steps

    def die(name: str) -> None:
        if name == crash_at:
            os._exit(17)

    _commit.crash_point = die  # the save calls it through the module at every step
    save(state, path, record={"step": steps})


if __name__ == "__main__":
    main()
