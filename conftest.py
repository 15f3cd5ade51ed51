"""Workspace-wide pytest settings shared by every package's tests.

Three things live here:

* the hypothesis profile;
* [Note: Warnings of ours are errors]: FutureWarning / DeprecationWarning caused by shardkit code
  fail the test, in the pytest process and in every process a test starts (ranks, torchrun);
* [Note: Docs run in CI]: the Python blocks of README.md, packages/*/README.md and docs/**/*.md
  are collected as tests (sybil).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

_ROOT = Path(__file__).resolve().parent

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


# [Note: Warnings of ours are errors]
# A warnings filter's module field matches the module the warning is *attributed* to: the frame
# that ``stacklevel`` points at. pyproject.toml's ``filterwarnings`` turns FutureWarning and
# DeprecationWarning attributed to ``shardkit.*`` into errors in the pytest process. Two gaps:
#
# 1. torch's deprecated collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...)
#    are wrapped twice, ``@_exception_logger`` over ``@deprecated``, so their FutureWarning is
#    attributed to ``torch.distributed.c10d_logger`` whoever calls them, never to the caller.
#    ``_attribute_to_caller`` below re-attributes a Deprecation/FutureWarning raised inside torch
#    to the first frame outside torch when that frame is shardkit code; the filters then apply.
# 2. ``@world`` ranks and the torchrun launches of the docs are separate interpreters that
#    never see pytest's filters. They inherit the environment, so PYTHONWARNINGS carries the
#    same rule there: one exact entry per shardkit module (PYTHONWARNINGS escapes its module
#    field, no regex), plus torch's mis-attributed deprecated collectives (gap 1; nothing run
#    in a rank calls one but shardkit, so there the rule is simply "never call one").
_WARNING_CATEGORIES = ("FutureWarning", "DeprecationWarning")
_TORCH_MODULES = re.compile(r"(torch|typing_extensions)(\.|$)")
_original_warn = getattr(warnings.warn, "_shardkit_original", warnings.warn)  # once per process


def _module_of(frame: Any) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _attribute_to_caller(
    message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **kwargs: Any
) -> None:
    """``warnings.warn``, with torch's deprecations attributed to the shardkit caller."""
    cat = (
        category
        if category is not None
        else type(message)
        if isinstance(message, Warning)
        else UserWarning
    )
    if isinstance(cat, type) and issubclass(cat, (DeprecationWarning, FutureWarning)):
        frame, level = sys._getframe(1), 1  # noqa: SLF001  (the stack is the point)
        while frame is not None and level < stacklevel:
            frame, level = frame.f_back, level + 1
        if frame is not None and _TORCH_MODULES.match(_module_of(frame)):
            while frame is not None and _TORCH_MODULES.match(_module_of(frame)):
                frame, level = frame.f_back, level + 1
            if frame is not None and _module_of(frame).startswith("shardkit."):
                stacklevel = level
    _original_warn(message, category, stacklevel + 1, source, **kwargs)


_attribute_to_caller._shardkit_original = _original_warn  # type: ignore[attr-defined]  # noqa: SLF001
warnings.warn = _attribute_to_caller


def _shardkit_modules() -> list[str]:
    names = []
    for src in sorted(_ROOT.glob("packages/*/src")):
        for path in sorted(src.glob("shardkit/**/*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _rank_warning_options() -> list[str]:
    entries = [f"error::{cat}:{mod}" for mod in _shardkit_modules() for cat in _WARNING_CATEGORIES]
    entries.append("error::FutureWarning:torch.distributed.c10d_logger")  # gap 1 above
    return entries


_existing = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
os.environ["PYTHONWARNINGS"] = ",".join(
    _existing + [e for e in _rank_warning_options() if e not in _existing]
)


# [Note: Docs run in CI]
# Every ```python block of README.md, packages/*/README.md and docs/**/*.md is a test (sybil).
# How a block runs is chosen by an HTML comment on the line just above its fence (invisible on
# GitHub and in the mkdocs site):
#
# * nothing: executed in this process; the blocks of one file share one namespace, in order,
#   with the working directory a fresh temporary directory per file;
# * ``<!-- run: torchrun --nproc-per-node 2 -->``: the block is a complete script, written to
#   ``example.py`` and launched with ``torchrun --standalone --nproc-per-node 2`` (Gloo on the
#   CPU), as the docs tell the reader to; it must exit 0, with no Gloo thread left at exit
#   ([Note: Gloo threads at exit]);
# * ``<!-- run: pytest -->``: the block is a test module, run by pytest in a subprocess (the
#   shardkit.testing plugin included); it must pass;
# * ``<!-- skip: next "reason" -->`` (sybil's own): not run; the reason is mandatory and shows
#   in the test report.
_DOC_RUN = re.compile(r"<!--\s*run:\s*(?P<how>[^>]*?)\s*-->[ \t]*\n[ \t]*\Z")
_DOC_TIMEOUT_S = 300
_OTHER_PYTHON_FENCE = re.compile(
    r"^[ \t]*```[ \t]*(py|python3|py3|pycon|Python|PYTHON)\b.*$", re.MULTILINE
)


def _is_doc(path: Path) -> bool:
    try:
        rel = path.resolve().relative_to(_ROOT)
    except ValueError:
        return False
    parts = rel.parts
    if rel.suffix != ".md":
        return False
    return (
        parts == ("README.md",)
        or (len(parts) == 3 and parts[0] == "packages" and parts[2] == "README.md")
        or parts[0] == "docs"
    )


def _launch(cmd: list[str], cwd: Path, what: str) -> str | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=_DOC_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"{what}: ran past {_DOC_TIMEOUT_S}s: {' '.join(cmd)}"
    if proc.returncode == 0:
        return None
    return (
        f"{what}: exit status {proc.returncode}: {' '.join(cmd)} (in {cwd})\n"
        f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-20000:]}"
    )


# [Note: Gloo threads at exit]
# torch 2.13's Gloo runloop threads take the GIL to release a finished work whose tensors have
# Python objects (intrusive_ptr's refcount 2 -> 1 calls ``decref_pyobject``). A process group
# still referenced when the interpreter exits (a DDP wrapper, an optimizer holding ``group``
# in a module global) is destroyed during finalization: a runloop thread that then asks for the
# GIL is ended by Python (``PyThread_exit_thread``) inside a noexcept destructor, and the rank
# aborts with "terminate called without an active exception" (seen about once in 20 runs of a
# docs example on a 2-core VM; gdb backtrace in the optim README's Limits).
# ``dist.destroy_process_group()`` alone does not stop the threads while Python objects still
# hold the group; dropping them (``del ddp, opt``) does, with the GIL released. So every
# torchrun example ends with its objects dropped, and this epilogue makes that a check: a
# Gloo runloop thread still alive at exit fails the example (exit status 3) instead of aborting
# it once in a while. An example whose group no user code can release says so, with the reason:
# ``<!-- run: torchrun --nproc-per-node 2; gloo-threads-at-exit: "why" -->`` (FSDP2: torch's
# DTensor caches keep the device mesh, and so its group, until exit).
_GLOO_EXIT_CHECK = """

# appended by conftest.py: [Note: Gloo threads at exit]
def _shardkit_docs_gloo_exit_check() -> None:
    import os as _os, sys as _sys
    tasks = _os.listdir("/proc/self/task") if _os.path.isdir("/proc/self/task") else []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    if any(n.startswith("pt_gloo_runloop") for n in names):
        print("Gloo runloop threads still alive at exit: drop what holds the process group "
              "(del ddp, opt, ...) before the interpreter exits", file=_sys.stderr, flush=True)
        _os._exit(3)


__import__("atexit").register(_shardkit_docs_gloo_exit_check)
"""


def _torchrun(nproc: int, exit_check: bool = True) -> Any:
    def evaluate(example: Any) -> str | None:
        script = Path.cwd() / f"example_line{example.line}.py"
        script.write_text(str(example.parsed) + (_GLOO_EXIT_CHECK if exit_check else ""))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), script.name,
        ]  # fmt: skip
        return _launch(cmd, script.parent, f"{example.path}:{example.line} under torchrun")

    return evaluate


def _pytest_block(example: Any) -> str | None:
    where = Path.cwd() / f"pytest_line{example.line}"
    where.mkdir()
    (where / "test_example.py").write_text(str(example.parsed))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".", "."]
    return _launch(cmd, where, f"{example.path}:{example.line} under pytest")


def _evaluator_for(how: str, where: str) -> Any:
    if how == "pytest":
        return _pytest_block
    found = re.fullmatch(
        r'torchrun\s+--nproc[-_]per[-_]node[\s=](\d+)(\s*;\s*gloo-threads-at-exit:\s*"[^"]+")?', how
    )
    if found:
        return _torchrun(int(found.group(1)), exit_check=found.group(2) is None)
    raise ValueError(
        f"{where}: unknown '<!-- run: {how} -->'; expected 'run: torchrun --nproc-per-node N' "
        "or 'run: pytest'"
    )


def _docs_sybil() -> Any:
    from sybil import Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

    python_blocks = PythonCodeBlockParser()
    skips = SkipParser()

    def blocks(document: Any) -> Any:
        other = _OTHER_PYTHON_FENCE.search(document.text)
        if other:  # would be silently left out: only ```python blocks are collected
            line = document.text.count("\n", 0, other.start()) + 1
            raise ValueError(
                f"{document.path}:{line}: tag Python blocks ```python, not {other[0]!r}"
            )
        for region in python_blocks(document):
            found = _DOC_RUN.search(document.text, 0, region.start)
            if found:
                where = f"{document.path}:{document.text.count(chr(10), 0, region.start) + 1}"
                region.evaluator = _evaluator_for(found.group("how"), where)
            yield region

    def skip_with_reason(document: Any) -> Any:
        for region in skips(document):
            action, reason = region.parsed
            if action == "next" and not (reason or "").strip():
                line = document.text.count("\n", 0, region.start) + 1
                raise ValueError(
                    f"{document.path}:{line}: '<!-- skip: next -->' needs a reason, e.g. "
                    "'<!-- skip: next \"needs 2 GPUs\" -->'"
                )
            yield region

    def setup(namespace: dict[str, Any]) -> None:
        namespace["__docs_cwd__"] = os.getcwd()
        namespace["__docs_tmp__"] = tempfile.mkdtemp(prefix="shardkit-docs-")
        os.chdir(namespace["__docs_tmp__"])

    def teardown(namespace: dict[str, Any]) -> None:
        os.chdir(namespace["__docs_cwd__"])
        shutil.rmtree(namespace["__docs_tmp__"], ignore_errors=True)

    return Sybil(
        parsers=[blocks, skip_with_reason],
        patterns=["*.md"],
        path=".",
        setup=setup,
        teardown=teardown,
        name="docs",
    ).pytest()


_collect_docs: Any = None


def _requested(file_path: Path, config: pytest.Config) -> bool:
    """Whether the run asked for ``file_path`` (or a folder holding it): pytest visits every
    file of the folders above the paths it was given, e.g. the root README.md of a run of one
    package's tests (``hatch run pkg.<name>:test``, an env without sybil)."""
    bases = (config.invocation_params.dir, config.rootpath)
    for arg in config.args:
        for base in bases:
            p = (base / arg.split("::")[0]).resolve()
            if file_path.resolve() == p or p in file_path.resolve().parents:
                return True
    return False


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Any:
    global _collect_docs
    if file_path.suffix != ".md" or not _is_doc(file_path):
        return None
    if _collect_docs is None:
        try:
            _collect_docs = _docs_sybil()
        except ImportError as exc:
            if not _requested(file_path, parent.config):
                return None
            raise pytest.UsageError(
                f"the docs' code blocks need sybil ({exc}); it is in hatch.toml's default env: "
                "run them with `hatch run test`"
            ) from None
    return _collect_docs(file_path, parent)
