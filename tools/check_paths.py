"""probe: every source file README.md and docs/ name exists (`solforge/db/cli.py`, `kernels/launch.py`,
`tools/timing_probe.py`, a bare `tidy.py`), and every `solforge.x.y` module path names a module.

    python tools/check_paths.py [FILE.md ...]

A name with a folder is looked for under the repository root, solforge/ and the page's own folder
(a link's ../ dropped); a bare file name must be some file's name in solforge/, bench/, tools/ or
tests/. Names with a placeholder (`<family>.py`, NAME, path/to/) are skipped. Prints each missing
one as `file:line: name` and exits 1 if there is any. check_links.py checks the links themselves.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILE = re.compile(r"(?<![\w./<>-])((?:\.\./)*[\w<>-]+(?:/[\w<>-]+)*\.py)\b")
MODULE = re.compile(r"(?<![\w/.-])solforge(?:\.[a-z_][\w]*)+")  # not a file name ending in solforge.json
SKIP = ("<", "NAME", "path/to/")
SOURCES = ("solforge", "bench", "tools", "tests")


def _bare_names() -> set[str]:
    return {p.name for top in SOURCES for p in (ROOT / top).rglob("*.py")}


def _module_exists(dotted: str) -> bool:
    # one name after the module is fine if the module's source has it (solforge.kernels.registry.FAMILIES)
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        src = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if src.is_file():
            rest = parts[n:]
            return not rest or (len(rest) == 1 and re.search(rf"\b{rest[0]}\b", src.read_text()) is not None)
    return False


def missing(md: Path, bare: set[str]) -> list[str]:
    bad: list[str] = []
    for n, line in enumerate(md.read_text().splitlines(), 1):
        for name in FILE.findall(line):
            if any(s in name for s in SKIP):
                continue
            rel = re.sub(r"^(\.\./)+", "", name)
            if "/" in rel:
                ok = any((base / rel).is_file() for base in (ROOT, ROOT / "solforge", md.parent))
            else:
                ok = rel in bare
            if not ok:
                bad.append(f"{md.relative_to(ROOT)}:{n}: {name}")
        for dotted in MODULE.findall(line):
            if not _module_exists(dotted):
                bad.append(f"{md.relative_to(ROOT)}:{n}: {dotted} (no such module)")
    return bad


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bare = _bare_names()
    bad = [b for f in files for b in missing(f, bare)]
    print("\n".join(bad) if bad else f"{len(files)} files: every named source file exists")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
