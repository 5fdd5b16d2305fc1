"""probe: every relative link in README.md and docs/ points at a file that exists (and a heading, for #anchors).

    python tools/check_links.py [FILE.md ...]

Prints each dead link as `file:line: target (why)` and exits 1 if there is any. Links to other
sites (http:, https:, mailto:) are not checked. Anchors are matched against GitHub's slugs of the
target's headings (lowercase, punctuation dropped, spaces as dashes).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def dead_links(md: Path) -> list[str]:
    bad: list[str] = []
    fenced = False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{md.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{md.relative_to(ROOT)}:{n}: {target} (no such heading)")
    return bad


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = [b for f in files for b in dead_links(f)]
    print("\n".join(bad) if bad else f"{len(files)} files: every relative link resolves")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
