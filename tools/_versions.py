"""PEP 440 versions and PEP 508 requirements for the repository tools.

`packaging` is used for requirement parsing and specifier matching when it is importable; otherwise
a small parser that covers the public PEP 440 grammar and the specifier operators takes over (the
tests compare both on generated inputs). Versions are always parsed here so that bumping and
ordering behave the same with or without `packaging`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import total_ordering

__all__ = [
    "HAVE_PACKAGING",
    "InvalidRequirement",
    "InvalidVersion",
    "Requirement",
    "Version",
    "canonical_name",
    "fallback_contains",
    "parse_requirement",
    "specs_admit",
]

try:  # pragma: no cover - depends on the environment
    from packaging.requirements import InvalidRequirement as _PInvalidRequirement
    from packaging.requirements import Requirement as _PRequirement
    from packaging.specifiers import InvalidSpecifier as _PInvalidSpecifier
    from packaging.specifiers import SpecifierSet as _PSpecifierSet

    HAVE_PACKAGING = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_PACKAGING = False


class InvalidVersion(ValueError):
    """A string that is not a PEP 440 version."""


class InvalidRequirement(ValueError):
    """A string that is not a PEP 508 requirement (or uses an unsupported form)."""


_VERSION_RE = re.compile(
    r"""
    ^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?))?
    (?P<dev>[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$
    """,
    re.VERBOSE | re.IGNORECASE,
)

_PRE_RANK = {"a": 0, "b": 1, "rc": 2}
_PRE_ALIASES = {"alpha": "a", "beta": "b", "c": "rc", "pre": "rc", "preview": "rc"}


@total_ordering
@dataclass(frozen=True, eq=False)
class Version:
    """A parsed PEP 440 version, ordered as PEP 440 specifies.

    Attributes:
        epoch: The epoch (`N!`), 0 when absent.
        release: The release segment, e.g. `(0, 2, 0)`.
        pre: The pre-release `("a" | "b" | "rc", number)`, or None.
        post: The post-release number, or None.
        dev: The dev-release number, or None.
        local: The local label segments (`+cpu` is `("cpu",)`), or None.
    """

    epoch: int
    release: tuple[int, ...]
    pre: tuple[str, int] | None
    post: int | None
    dev: int | None
    local: tuple[str, ...] | None

    @classmethod
    def parse(cls, text: str) -> Version:
        """Parse `text`, raising `InvalidVersion` with the offending value if it is not PEP 440."""
        if not isinstance(text, str):
            raise InvalidVersion(f"expected a version string, got {type(text).__name__} {text!r}")
        m = _VERSION_RE.match(text)
        if m is None:
            raise InvalidVersion(
                f"{text!r} is not a PEP 440 version; use a form like 1.2.3, 1.2.3rc1 or 1.2.3.post1"
            )
        pre: tuple[str, int] | None = None
        if m.group("pre_l"):
            letter = m.group("pre_l").lower()
            pre = (_PRE_ALIASES.get(letter, letter), int(m.group("pre_n") or 0))
        post: int | None = None
        if m.group("post"):
            post = int(m.group("post_n1") or m.group("post_n2") or 0)
        dev = int(m.group("dev_n") or 0) if m.group("dev") else None
        local = None
        if m.group("local"):
            local = tuple(re.split(r"[-_.]", m.group("local").lower()))
        return cls(
            epoch=int(m.group("epoch") or 0),
            release=tuple(int(x) for x in m.group("release").split(".")),
            pre=pre,
            post=post,
            dev=dev,
            local=local,
        )

    @property
    def is_prerelease(self) -> bool:
        """True for `a`/`b`/`rc` and `.dev` versions."""
        return self.pre is not None or self.dev is not None

    @property
    def is_postrelease(self) -> bool:
        """True for `.postN` versions."""
        return self.post is not None

    @property
    def public(self) -> Version:
        """This version without its local label."""
        return Version(self.epoch, self.release, self.pre, self.post, self.dev, None)

    @property
    def base(self) -> Version:
        """Epoch and release only."""
        return Version(self.epoch, self.release, None, None, None, None)

    def _key(self) -> tuple[object, ...]:
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        # Same ordering rules as PEP 440 (and packaging's _cmpkey): a dev release of a final
        # version sorts before its pre-releases; no post sorts before any post; no dev sorts after
        # any dev; local labels sort after the public version, numbers after strings.
        if self.pre is None and self.post is None and self.dev is not None:
            pre_key: tuple[int, int] = (-1, 0)
        elif self.pre is None:
            pre_key = (3, 0)
        else:
            pre_key = (_PRE_RANK[self.pre[0]], self.pre[1])
        post_key = -1 if self.post is None else self.post
        dev_key: float = math.inf if self.dev is None else self.dev
        local_key: tuple[tuple[float, str], ...] = ()
        if self.local is not None:
            local_key = tuple((float(s), "") if s.isdigit() else (-math.inf, s) for s in self.local)
            # A local version sorts after the same public version: make it non-empty.
            local_key = ((math.inf, ""), *local_key)
        return (self.epoch, tuple(release), pre_key, post_key, dev_key, local_key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: Version) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        out = f"{self.epoch}!" if self.epoch else ""
        out += ".".join(str(x) for x in self.release)
        if self.pre is not None:
            out += f"{self.pre[0]}{self.pre[1]}"
        if self.post is not None:
            out += f".post{self.post}"
        if self.dev is not None:
            out += f".dev{self.dev}"
        if self.local is not None:
            out += "+" + ".".join(self.local)
        return out


def canonical_name(name: str) -> str:
    """PEP 503 normalised distribution name (`Shardkit_Optim` -> `shardkit-optim`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


_OPS = ("===", "~=", "==", "!=", "<=", ">=", "<", ">")


@dataclass(frozen=True)
class Requirement:
    """A parsed PEP 508 requirement.

    Attributes:
        raw: The string as written in pyproject.toml.
        name: The distribution name as written.
        extras: Requested extras.
        specs: `(operator, version)` pairs, in the order written.
        url: The direct reference (`name @ url`), or None.
        marker: The environment marker text, or None.
    """

    raw: str
    name: str
    extras: tuple[str, ...]
    specs: tuple[tuple[str, str], ...]
    url: str | None
    marker: str | None

    @property
    def key(self) -> str:
        """The normalised distribution name."""
        return canonical_name(self.name)

    @property
    def specifier(self) -> str:
        """The specifiers joined by commas, e.g. `>=0.1,<0.2`."""
        return ",".join(op + v for op, v in self.specs)

    def with_specs(self, specs: tuple[tuple[str, str], ...]) -> Requirement:
        """The same requirement (name, extras, marker) with other specifiers."""
        text = self.name
        if self.extras:
            text += "[" + ",".join(self.extras) + "]"
        text += ",".join(op + v for op, v in specs)
        if self.marker:
            text += "; " + self.marker
        return parse_requirement(text)


_NAME_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*")
_EXTRAS_RE = re.compile(r"^\[\s*([^\]]*)\]\s*")
_SPEC_RE = re.compile(r"^\s*(===|~=|==|!=|<=|>=|<|>)\s*([^,;\s)]+)\s*")


def _fallback_parse(text: str) -> Requirement:
    rest = text
    m = _NAME_RE.match(rest)
    if m is None:
        raise InvalidRequirement(f"{text!r}: expected a distribution name first")
    name, rest = m.group(1), rest[m.end() :]
    extras: tuple[str, ...] = ()
    m = _EXTRAS_RE.match(rest)
    if m is not None:
        extras = tuple(e.strip() for e in m.group(1).split(",") if e.strip())
        rest = rest[m.end() :]
    marker: str | None = None
    if ";" in rest:
        rest, marker_text = rest.split(";", 1)
        marker = marker_text.strip() or None
        if marker is None:
            raise InvalidRequirement(f"{text!r}: empty environment marker after ';'")
    rest = rest.strip()
    url: str | None = None
    specs: list[tuple[str, str]] = []
    if rest.startswith("@"):
        url = rest[1:].strip()
        if not url:
            raise InvalidRequirement(f"{text!r}: empty URL after '@'")
    elif rest:
        if rest.startswith("(") and rest.endswith(")"):
            rest = rest[1:-1]
        for part in rest.split(","):
            sm = _SPEC_RE.match(part)
            if sm is None or sm.end() != len(part):
                raise InvalidRequirement(f"{text!r}: cannot parse the specifier {part.strip()!r}")
            op, ver = sm.group(1), sm.group(2)
            if op != "===":
                body = ver[:-2] if op in ("==", "!=") and ver.endswith(".*") else ver
                try:
                    Version.parse(body)
                except InvalidVersion as exc:
                    raise InvalidRequirement(f"{text!r}: {exc}") from None
            specs.append((op, ver))
    return Requirement(text, name, extras, tuple(specs), url, marker)


def parse_requirement(text: str) -> Requirement:
    """Parse a PEP 508 requirement string, raising `InvalidRequirement` with the reason."""
    if not isinstance(text, str):
        raise InvalidRequirement(
            f"expected a requirement string, got {type(text).__name__} {text!r}"
        )
    if not HAVE_PACKAGING:
        return _fallback_parse(text)
    try:
        req = _PRequirement(text)
    except _PInvalidRequirement as exc:
        raise InvalidRequirement(f"{text!r}: {exc}") from None
    specs = tuple((s.operator, s.version) for s in req.specifier)
    # SpecifierSet iterates in an unspecified order: keep the order written.
    order = {s: text.find(s[0] + s[1]) for s in specs}
    specs = tuple(sorted(specs, key=lambda s: order[s]))
    marker = str(req.marker) if req.marker is not None else None
    return Requirement(text, req.name, tuple(sorted(req.extras)), specs, req.url, marker)


def _release_prefix_match(version: Version, prefix: str) -> bool:
    """`==prefix.*` for a numeric prefix (possibly with an epoch)."""
    spec = Version.parse(prefix)
    if spec.epoch != version.epoch:
        return False
    if spec.pre is not None or spec.post is not None or spec.dev is not None:
        # `==1.0rc1.*`-style prefixes: compare canonical strings of the public part.
        return str(version.public).startswith(str(spec))
    n = len(spec.release)
    padded = version.release + (0,) * max(0, n - len(version.release))
    return padded[:n] == spec.release


def _fallback_one(op: str, spec_text: str, version: Version) -> bool:
    if op == "===":
        return str(version).lower() == spec_text.lower()
    if op in ("==", "!=") and spec_text.endswith(".*"):
        matched = _release_prefix_match(version, spec_text[:-2])
        return matched if op == "==" else not matched
    spec = Version.parse(spec_text)
    if op in ("==", "!="):
        equal = version == spec if spec.local is not None else version.public == spec
        return equal if op == "==" else not equal
    if op == ">=":
        return version.public >= spec
    if op == "<=":
        return version.public <= spec
    if op == "<":
        if not version < spec:
            return False
        return spec.is_prerelease or not version.is_prerelease or version.base != spec.base
    if op == ">":
        if not version > spec:
            return False
        if not spec.is_postrelease and version.is_postrelease and version.base == spec.base:
            return False
        return not (version.local is not None and version.base == spec.base)
    if op == "~=":
        if len(spec.release) < 2:
            raise InvalidRequirement(f"'~={spec_text}' needs at least two release components")
        prefix = ".".join(str(x) for x in spec.release[:-1])
        if spec.epoch:
            prefix = f"{spec.epoch}!{prefix}"
        return version.public >= spec and _release_prefix_match(version, prefix)
    raise InvalidRequirement(f"unknown specifier operator {op!r}")


def fallback_contains(specs: tuple[tuple[str, str], ...], version: str) -> bool:
    """Whether every specifier admits `version` (pre-releases allowed), without `packaging`."""
    parsed = Version.parse(version)
    return all(_fallback_one(op, v, parsed) for op, v in specs)


def specs_admit(specs: tuple[tuple[str, str], ...], version: str) -> bool:
    """Whether the specifiers admit `version`; pre-releases count as admitted when in range."""
    if not HAVE_PACKAGING:
        return fallback_contains(specs, version)
    try:
        spec_set = _PSpecifierSet(",".join(op + v for op, v in specs))
    except _PInvalidSpecifier as exc:
        raise InvalidRequirement(str(exc)) from None
    return bool(spec_set.contains(version, prereleases=True))
