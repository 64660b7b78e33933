"""Every Python block of every documentation page (docs/*.md and the README) runs as written.

A page's blocks run in order in one namespace, from a scratch directory, as a reader would paste them. Pages whose
blocks are run by a test that also checks what they compute are listed in `RUN_ELSEWHERE` (with that test), so the
suite runs each block once; the site's navigation is checked to list every page.
"""

import re
from pathlib import Path

import pytest
from conftest import DOCS, ROOT, doc_blocks, doc_page, run_doc_blocks

# page -> the test that runs its blocks (with run_doc_blocks) and checks their results
RUN_ELSEWHERE = {
    "moe": "tests/test_moe.py::test_docs_moe_blocks_run",
    "fast-inference": "tests/test_quantization.py::test_docs_fast_inference_blocks",
    "seq2seq": "tests/test_seq2seq_training.py::test_docs_seq2seq_blocks",
    "training": "tests/test_training.py::test_docs_training_blocks",
    "share-on-hub": "tests/test_doc_jobs.py::test_share_on_hub_page",
    "llama-cpp": "tests/test_doc_jobs.py::test_llama_cpp_page",
    "own-architecture": "tests/test_doc_jobs.py::test_own_architecture_page",
    "reference/api": "tests/test_docs_reference.py::test_api_reference_blocks",
}
# How a page is made and tested, this project's machine, today's releases: maintainer notes, which belong in
# docs/development.md. A user page says what the user gets.
MAINTAINER_NOTES = re.compile(
    r"\bthe main job\b|\bthis project's\b|\bnot tested here\b|\btoday\b|\btests/test_\w+\.py|\btest suite fails"
    r"|\bout of date\b|\bregenerat|scripts/gen_\w+\.py|\brun by the tests\b|\bthe tests run\b|\bsteps/s\b",
    re.IGNORECASE,
)
NOT_USER_PAGES = {"development"}


def page_names() -> list[str]:
    return ["README", *sorted(str(p.relative_to(DOCS).with_suffix("")) for p in DOCS.rglob("*.md"))]


PAGES_WITH_CODE = [page for page in page_names() if doc_blocks(page) and page not in RUN_ELSEWHERE]


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_page_blocks_run(page, tmp_path, monkeypatch):
    run_doc_blocks(page, len(doc_blocks(page)), tmp_path, monkeypatch)


@pytest.mark.parametrize("page", sorted(RUN_ELSEWHERE))
def test_pages_run_elsewhere_are_run(page):
    path, name = RUN_ELSEWHERE[page].split("::")
    source = (ROOT / path).read_text()
    body = source[source.index(f"def {name}(") :].split("\ndef ", 1)[0]
    assert re.search(rf'(run_doc_blocks|doc_blocks)\("{page}"', body), f"{name} does not run {page}'s blocks"


@pytest.mark.parametrize("page", [p for p in page_names() if p not in NOT_USER_PAGES])
def test_user_pages_carry_no_maintainer_notes(page):
    """What the tests check, how a page is regenerated, the project's own machine: docs/development.md's, not here
    (HTML comments, which readers do not see, may name them)."""
    text = re.sub(r"<!--.*?-->", "", doc_page(page).read_text(), flags=re.DOTALL)
    found = sorted({match.group(0) for match in MAINTAINER_NOTES.finditer(text)})
    assert not found, f"{page}: maintainer notes {found}"


def test_maintainer_note_check_finds_them():
    for note in ("the main job", "Measured on this project's machine", "not tested here", "(5.25.0 today)",
                 "run by the tests (`tests/test_training.py`)", "the test suite fails while the page is out of date",
                 "python scripts/gen_perf_page.py rewrites it", "0.99 steps/s"):  # fmt: skip
        assert MAINTAINER_NOTES.search(note), note
    assert not MAINTAINER_NOTES.search("make test      # the test suite; hf-tfm push uploads a folder")


def test_navigation_lists_every_page():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE)
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(nav), f"missing from nav: {pages - set(nav)}; in nav but absent: {set(nav) - pages}"


def test_readme_is_short_and_links_to_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def heading_anchors(path: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (its toc slugify: lower case, punctuation dropped, spaces -> '-')."""
    headings = re.findall(
        r"^#+ (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE), re.M
    )
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}


def test_every_command_help_names_its_page():
    from hf_tfm.cli import DOC_PAGES, build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(DOC_PAGES) == set(commands)
    for name, command in commands.items():
        assert DOC_PAGES[name] in " ".join(command.format_help().split()), name
        for page, anchor in re.findall(r"(docs/[\w/-]+\.md)(?:#([\w-]+))?", DOC_PAGES[name]):
            assert (ROOT / page).is_file(), (name, page)
            assert not anchor or anchor in heading_anchors(ROOT / page), (name, page, anchor)
