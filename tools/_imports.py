"""Static import analysis for `tools/check_packages.py`.

Every `import`/`from ... import` anywhere in a module counts (module level, inside functions,
under `if TYPE_CHECKING:` or `try:`), relative imports are resolved against the module's own
package, and `importlib.import_module("x")` / `__import__("x")` with a literal name count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ImportRef", "collect_imports", "iter_modules", "module_name"]


@dataclass(frozen=True)
class ImportRef:
    """One imported module.

    Attributes:
        module: Absolute dotted name (`shardkit.buckets`, `torch.distributed`).
        line: Line number in the importing file.
        error: Set instead of a usable `module` when the import cannot be resolved.
    """

    module: str
    line: int
    error: str | None = None


def iter_modules(src_dir: Path) -> Iterator[Path]:
    """Every `.py` file under `src_dir`, sorted, skipping `__pycache__`."""
    for path in sorted(src_dir.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def module_name(path: Path, src_root: Path) -> str:
    """Dotted module name of `path` relative to `src_root` (`__init__.py` names its package)."""
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(package: str, level: int, module: str | None) -> str | None:
    parts = package.split(".") if package else []
    if level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    if module:
        base.append(module)
    return ".".join(base)


def _literal_import_call(node: ast.Call) -> str | None:
    func = node.func
    is_import = (isinstance(func, ast.Name) and func.id in ("__import__", "import_module")) or (
        isinstance(func, ast.Attribute) and func.attr == "import_module"
    )
    if not is_import or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value:
        return arg.value
    return None


def collect_imports(source: str, modname: str, is_package: bool, filename: str) -> list[ImportRef]:
    """All imports of one module. Raises `SyntaxError` if the source does not parse."""
    tree = ast.parse(source, filename=filename)
    package = modname if is_package else modname.rpartition(".")[0]
    refs: list[ImportRef] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            refs.extend(ImportRef(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(package, node.level, node.module)
                if base is None:
                    dots = "." * node.level
                    refs.append(
                        ImportRef(
                            "",
                            node.lineno,
                            f"relative import 'from {dots}{node.module or ''} import ...' goes "
                            f"above the top-level package of {modname}",
                        )
                    )
                    continue
            else:
                base = node.module or ""
            refs.append(ImportRef(base, node.lineno))
            # `from shardkit import optim` / `from .. import optim` import the sibling package.
            if base == "shardkit":
                refs.extend(
                    ImportRef(f"shardkit.{a.name}", node.lineno)
                    for a in node.names
                    if a.name != "*"
                )
        elif isinstance(node, ast.Call):
            name = _literal_import_call(node)
            if name is not None and not name.startswith("."):
                refs.append(ImportRef(name, node.lineno))
    return refs
