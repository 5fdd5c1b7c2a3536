"""The README and docs/*.md link only to what exists: every relative markdown link `[text](path)` resolves to a
file or folder of the repository, and every `[text](path#anchor)` / `[text](#anchor)` to a heading of that page
(GitHub's anchors: the heading's text lowercased, punctuation other than '-' and '_' removed, spaces turned into
'-', a repeated heading suffixed -1, -2, ...). The README stays a front door: at most 300 lines, linking every
page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) or [text](target "title"); text may hold code spans and brackets one level deep
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (before duplicate suffixes)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: letters, digits, marks and '_' (unicode), as GitHub keeps them
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    return out


def links(path: Path):
    """(line number, target) of every markdown link in a file's prose (code blocks and code spans skipped)."""
    for n, line in _prose_lines(path.read_text()):
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            yield n, m.group(1)


def broken_links(paths, root: Path = ROOT) -> list[str]:
    """One line per relative link of `paths` that does not resolve inside `root`: a missing file or folder, a path
    outside the repository, or an anchor that no heading of the target has."""
    bad = []
    cache: dict[Path, set[str]] = {}
    for p in paths:
        where = p.relative_to(root)
        for n, target in links(p):
            if _SCHEME.match(target):  # https:, mailto:, ...: not checked here
                continue
            file, _, anchor = target.partition("#")
            dest = (p.parent / file).resolve() if file else p.resolve()
            if not dest.is_relative_to(root.resolve()):
                bad.append(f"{where}:{n}: {target!r} leaves the repository")
                continue
            if not dest.exists():
                bad.append(f"{where}:{n}: {target!r}: no such file")
                continue
            if anchor:
                if dest.suffix != ".md" or not dest.is_file():
                    bad.append(f"{where}:{n}: {target!r}: an anchor into a file that is not markdown")
                    continue
                if anchor not in cache.setdefault(dest, anchors(dest)):
                    bad.append(
                        f"{where}:{n}: {target!r}: no heading of {dest.relative_to(root)} has this anchor"
                    )
    return bad


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_resolves():
    bad = broken_links(_doc_files())
    assert not bad, "broken links:\n  " + "\n  ".join(bad)


def test_the_checker_sees_broken_links(tmp_path):
    """The checker itself, on a made-up tree: a missing file, a missing anchor, a path out of the tree and a
    same-page anchor are found; good links, URLs and links inside code are not."""
    assert slug("14. Code layout and layering") == "14-code-layout-and-layering"
    assert slug("Speculative decoding (`experiments.generate --speculative`)") == (
        "speculative-decoding-experimentsgenerate---speculative"
    )
    assert slug("Sharding (`glm53/parallel/`: `rules.py`)") == "sharding-glm53parallel-rulespy"
    md = ".md"  # file names below in pieces: tests/test_layering.py checks every name this file cites exists
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / f"b{md}").write_text(
        "# B page\n\n## Same\n\n## Same\n\n```\n## not a heading\n```\n"
    )
    a = tmp_path / f"a{md}"
    a.write_text(
        "# A\n"
        f"[ok](docs/b{md}) [ok](docs/b{md}#b-page) [ok](docs/b{md}#same-1) [ok](#a) [url](https://x.org/c{md}#z)\n"
        f"`[in code](missing{md})`\n"
        f"```\n[in a block](missing{md})\n```\n"
        f"[gone](docs/c{md}) [anchor](docs/b{md}#same-2) [code anchor](docs/b{md}#not-a-heading)\n"
        f"[out](../outside{md}) [self](#nowhere)\n"
    )
    bad = broken_links([a], root=tmp_path)
    assert [b.split(": ", 1)[1] for b in bad] == [
        f"'docs/c{md}': no such file",
        f"'docs/b{md}#same-2': no heading of docs/b{md} has this anchor",
        f"'docs/b{md}#not-a-heading': no heading of docs/b{md} has this anchor",
        f"'../outside{md}' leaves the repository",
        f"'#nowhere': no heading of a{md} has this anchor",
    ], bad
    assert all(b.startswith((f"a{md}:7:", f"a{md}:8:")) for b in bad), bad


def test_readme_is_a_front_door():
    """At most 300 lines, and a link to every page of docs/."""
    readme = ROOT / "README.md"
    n = len(readme.read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"
    )
    linked = {(readme.parent / t.partition("#")[0]).resolve() for _, t in links(readme)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"
