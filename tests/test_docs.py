"""The documentation a clone ships: every relative link resolves to a file inside the repository,
and nothing points outside it (a clone has no ../shared or other sibling folders)."""

from __future__ import annotations

import glob
import os
import re

import pytest

from .conftest import ROOT

DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
# [text](target) and ![alt](target), target up to whitespace or ')'; code spans removed first.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def links(text: str) -> list[str]:
    return _LINK.findall(_CODE.sub("", text))


def test_the_docs_exist():
    assert "docs/architecture.md" in DOCS
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "docs/architecture.md" in links(readme)


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_inside_the_repository(doc):
    text = open(os.path.join(ROOT, doc)).read()
    found = links(text)
    assert found or doc != "README.md"
    root = os.path.realpath(ROOT)
    for target in found:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, in-page anchors
        path = os.path.realpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
        assert os.path.commonpath([root, path]) == root, f"{doc}: {target} leaves the repository"
        assert os.path.exists(path), f"{doc}: {target} does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_nothing_points_outside_the_repository(doc):
    text = open(os.path.join(ROOT, doc)).read()
    assert "../shared" not in text and "DESIGN.md" not in text, doc
    assert not re.search(r"\]\(\s*\.\./", text), f"{doc} links above the repository root"


def test_link_parser_sees_what_a_renderer_sees():
    text = "a [x](docs/a.md) ![p](b.png) `[no](c.md)` [web](https://e.org) [t](d.md \"title\")"
    assert links(text) == ["docs/a.md", "b.png", "https://e.org", "d.md"]
