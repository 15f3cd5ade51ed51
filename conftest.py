"""Workspace-wide pytest settings shared by every package's tests."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Shared 2-core machines make wall-clock deadlines meaningless: hypothesis checks properties,
# not speed (speed lives in benchmarks/).
settings.register_profile(
    "shardkit",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI", "").lower() == "true",
)
settings.load_profile("shardkit")

# shardkit-testing's own tests run inner pytest sessions (a hanging test, a failing rank, ...).
pytest_plugins = ["pytester"]
