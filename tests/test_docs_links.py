"""The README and docs/ as a newcomer reads them: short, the two commands first, every relative link resolving.

The benchmark record (bench/RESULTS.md and its archived notebook) is link-checked too.

A relative link resolves when its file exists inside the repository and,
for a `#fragment` into a Markdown file (or the page itself), when that file
has a heading whose GitHub anchor is the fragment. Links inside fenced code
blocks and inline code are not links; `http(s):` and `mailto:` links are not
checked (no network).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: The pages the documentation must have (issue 41).
PAGES = ["architecture", "decoding", "serving", "checkpoints", "distributed", "cpu-backend", "metal", "development"]
#: The README's first two commands; CI runs the second (`.ci/run`).
INSTALL = 'pip install . && mtplx-ext generate "def fibonacci(n):" "import os"'
TEST = 'pip install ".[test]" && pytest -q'
MAX_README_LINES = 300

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(markdown: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return _CODE_SPAN.sub("", _FENCE.sub("", markdown))


def links(markdown: str) -> list[str]:
    """Targets of the inline links and images of `markdown`, in order, code excluded."""
    return [m.group(1) for m in _LINK.finditer(_prose(markdown))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of `markdown` (repeated headings get -1, -2, ... as on GitHub)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for m in _HEADING.finditer(_FENCE.sub("", markdown)):
        a = anchor(m.group(2))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def broken_links(page: Path, text: str | None = None, root: Path = ROOT) -> list[str]:
    """The relative links of `page` (its file's text, or `text` as if it were at `page`) that do not resolve.

    Returns one "target: why" line per broken link (empty when all resolve).
    """
    text = page.read_text() if text is None else text
    bad = []
    for target in links(text):
        if _EXTERNAL.match(target):
            continue
        path, _, fragment = target.partition("#")
        if not path:  # a heading of this page
            if fragment not in anchors(text):
                bad.append(f"{target}: no heading #{fragment} in {page.name}")
            continue
        dest = (page.parent / path).resolve()
        if root.resolve() not in dest.parents and dest != root.resolve():
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file {dest.relative_to(root.resolve())}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    return bad


def _pages() -> list[Path]:
    bench = [ROOT / "bench" / "RESULTS.md", ROOT / "bench" / "results" / "archive" / "NOTEBOOK.md"]
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *bench]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in _pages() for b in broken_links(p)]
    assert not bad, "\n".join(bad)


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## The `depth=\"auto\"` choice\n")
    page = tmp_path / "docs" / "page.md"
    text = (
        "# Page\n\n## Local part\n\n"
        "[ok](other.md) [ok anchor](other.md#the-depthauto-choice) [ok self](#local-part) "
        "[ok web](https://example.com/missing) ![ok image](other.md)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading) [bad self](#nowhere) "
        "[escape](../../outside.md)\n\n"
        "```\n[in code](missing-in-code.md)\n```\n`[inline](missing-inline.md)`\n"
    )
    bad = broken_links(page, text, root=tmp_path)
    assert [b.split(":")[0] for b in bad] == ["missing.md", "other.md#no-such-heading", "#nowhere", "../../outside.md"]


def test_anchors_follow_github():
    assert anchor("The C++ primitives") == "the-c-primitives"
    assert anchor("The continuous-batching engine (`batching/engine.py`)") == \
        "the-continuous-batching-engine-batchingenginepy"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_the_docs_have_their_pages():
    missing = [p for p in PAGES if not (DOCS / f"{p}.md").is_file()]
    assert not missing, f"docs/ lacks {missing}"
    readme = (ROOT / "README.md").read_text()
    unlinked = [p for p in PAGES if f"(docs/{p}.md)" not in readme]
    assert not unlinked, f"the README does not link {unlinked}"


def test_the_readme_is_short_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    blocks = re.findall(r"^```bash\n(.*?)\n```$", "\n".join(lines[:40]), re.M | re.S)
    assert blocks[:2] == [INSTALL, TEST], blocks
