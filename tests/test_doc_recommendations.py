"""The documentation gives one answer per question, on every page, and one statement of the supported releases.

- A question with one answer (which setting for CPU decoding, which export for a runtime, which attention
  implementation, which GGUF type) is answered by the line under a `<!-- recommendation: NAME -->` marker; every page
  that carries the marker carries the same line, and every page that names a decoding setting carries the CPU-decoding
  line.
- docs/releases.md's table states which transformers releases each feature runs on and which CI tests: its releases
  are the Makefile's `MATRIX` and `COMMON_ENDS` and pyproject's transformers range, and no other page restates the
  range.
- docs/performance.md's results are what scripts/gen_perf_page.py writes from the results files it names.
"""

import json
import re

import pytest
from conftest import DOCS, ROOT, doc_page, load_script

MARKER = re.compile(r"^<!-- recommendation: ([\w-]+) -->\n(.+)$", re.MULTILINE)
# Pages that name the CPU decoding settings or the calls that take them, and so must give the recommendation.
NAMES_A_DECODING_SETTING = re.compile(r"quantize=\"q[48]\"|--quantize q[48]\b|load_for_inference\(")
# Pages that may name the settings without recommending: the history, the reference generated from docstrings, the
# traps (each fix names the call it needs), and the developers' page.
NOT_ADVICE = {"changelog", "reference/api", "reference/configuration", "troubleshooting", "development"}
GENERATED = {"reference/configuration"}  # written by a script from the code, not edited by hand


def pages() -> list[str]:
    return ["README", *sorted(str(p.relative_to(DOCS).with_suffix("")) for p in DOCS.rglob("*.md"))]


def recommendations() -> dict[str, dict[str, str]]:
    """question -> {page: the line under its marker}."""
    found: dict[str, dict[str, str]] = {}
    for page in pages():
        for question, line in MARKER.findall(doc_page(page).read_text()):
            assert page not in found.get(question, {}), f"{page}: two {question} recommendations"
            found.setdefault(question, {})[page] = line
    return found


def test_each_question_has_one_answer_everywhere():
    found = recommendations()
    assert set(found) == {"cpu-decoding", "export", "attention", "gguf-type", "scale-out"}, set(found)
    for question, lines in found.items():
        assert len(set(lines.values())) == 1, f"{question}: the pages answer differently: {lines}"
    (cpu,) = set(found["cpu-decoding"].values())
    assert 'load_for_inference(folder, quantize="q4")' in cpu and "--quantize q4" in cpu and "generate(" in cpu
    (export,) = set(found["export"].values())
    assert all(f"`{name}`" in export for name in ("onnx", "ctranslate2", "executorch")) and "--format gguf" in export
    assert "AVX-512 VNNI" in cpu and "C++ compiler" in cpu and "fall back" in cpu  # q4's precondition, and without it
    (gguf,) = set(found["gguf-type"].values())
    assert gguf.startswith("**Which GGUF type:** `q4_k_m`") and "`q8_0`" in gguf
    (engine,) = set(found["scale-out"].values())
    assert all(name in engine for name in ("FSDP2", "ZeRO-3 with CPU offload", "Ray Train")), engine


@pytest.mark.parametrize("page", pages())
def test_pages_naming_a_decoding_setting_give_the_recommendation(page):
    text = doc_page(page).read_text()
    if page in NOT_ADVICE or not NAMES_A_DECODING_SETTING.search(text):
        return
    assert page in recommendations()["cpu-decoding"], f"{page} names a decoding setting without the recommendation"


@pytest.mark.parametrize("page", pages())
def test_removed_apis_are_named_only_by_the_changelog(page):
    if page != "changelog":
        assert not re.search(r"AotDecoder|--aot\b", doc_page(page).read_text()), page


def test_the_task_pages_open_with_their_recommendation():
    """The answer is on the page's first screen: before the first section heading."""
    openers = {
        "fast-inference": "cpu-decoding",
        "deployment": "export",
        "performance": "cpu-decoding",
        "llama-cpp": "gguf-type",
        "scale-out": "scale-out",
    }
    for page, question in openers.items():
        head = doc_page(page).read_text().split("\n## ")[0]
        assert f"<!-- recommendation: {question} -->" in head, page


# ---------------------------------------------------------------------------------------------------------------------
# Supported releases


def makefile_list(name: str) -> list[str]:
    match = re.search(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile sets no {name}"
    return match[1].split()


def releases_table() -> dict[str, list[str]]:
    """feature -> its cells (releases, environment, CI runs it on), from the table under the marker."""
    text = (DOCS / "releases.md").read_text()
    table = text.split("<!-- releases-table", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
    assert all(len(row) == 4 for row in cells), cells
    return {row[0]: row[1:] for row in cells}


def versions(cell: str) -> set[str]:
    return set(re.findall(r"\b5\.\d+\.\d+\b", cell))


def test_releases_table_matches_ci_and_pyproject():
    matrix, common_ends = makefile_list("MATRIX"), makefile_list("COMMON_ENDS")
    spec = re.search(r'^\s*"transformers>=([\d.]+),<([\d.]+)",$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    low, high = spec.groups()
    table = releases_table()
    core_releases, _, core_ci = next(cells for feature, cells in table.items() if feature.startswith("hf_tfm itself"))
    assert core_releases == f"{low} to the newest 5.x (< {high})", core_releases
    # CI: every release of the matrix and the newest; transformers' common tests on the range's ends
    assert versions(core_ci) == set(matrix) and "newest" in core_ci, core_ci
    common_ci = next(cells[2] for feature, cells in table.items() if "common model tests" in feature)
    assert versions(common_ci) == set(common_ends) and "newest" in common_ci, common_ci
    for feature, (releases, _, ci) in table.items():
        for version in versions(releases) | versions(ci):
            assert tuple(map(int, version.split("."))) >= tuple(map(int, low.split("."))) or "own" in releases, (
                f"{feature}: {version} is below the supported range"
            )


def test_only_the_releases_page_states_the_range():
    """Other pages link to docs/releases.md instead of restating which releases are supported."""
    restated = re.compile(r"5\.16(\.1)? (through|to) (the newest|5\.)")
    for page in pages():
        if page in {"releases", "changelog"}:
            continue
        assert not restated.search(doc_page(page).read_text()), f"{page} restates the supported range"


# ---------------------------------------------------------------------------------------------------------------------
# Generated content


def test_performance_page_is_what_its_generator_writes():
    gen = load_script(ROOT / "scripts" / "gen_perf_page.py", "hf_tfm_gen_perf_page")
    assert gen.main(["--check"]) == 0, "docs/performance.md is out of date: run python scripts/gen_perf_page.py"
    page = (DOCS / "performance.md").read_text()
    for run in gen.load(gen.page_files(page)):  # every chart the page shows is there
        if run["kind"] != "quality":
            assert gen.chart_path(run).is_file(), gen.chart_path(run)


def test_perf_generator_groups_runs_by_kind_and_machine(tmp_path):
    gen = load_script(ROOT / "scripts" / "gen_perf_page.py", "hf_tfm_gen_perf_page")
    machine = {"cpu": "Test CPU(R)", "cpu_count": 2, "torch_threads": 2, "torch": "2.13.0", "transformers": "5.25.0"}
    run = {
        "machine": {**machine, "date": "2026-01-02", "caches": {"L2": "1 MiB"}},
        "command": "scripts/bench.py --size base --runtimes all --json /tmp/x.json --charts /tmp/c",
        "args": {"size": "base"},
        "bandwidth": {"bytes": 2**31, "bytes_per_s": 3e10, "bytes_per_s_by_kernel": {"mkl": 2e10, "inductor": 3e10}},
        "runtimes": [
            {"setting": "a", "what": "x | y", "weight_bytes_per_step": 4e8, "b1_step_s": 0.01, "b8_step_s": 0.02,
             "b1_bandwidth_frac": 0.5},
            {"setting": "b", "what": "z", "error": "ImportError: no"},
        ],
    }  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    block = gen.render_block(gen.load([path]))
    assert "## Decoding speed" in block and "### Test CPU" in block and "(R)" not in block
    assert "| date | 2026-01-02 |" in block and "L2 1 MiB" in block and "TODO(bench)" not in block
    command = re.sub(r"<[^>]+>", "", block)  # the command is HTML: each word a span, a <wbr> after each comma
    assert "/tmp/x.json" not in block and "--charts" not in block and f"--json {path}" in command
    assert "| a | x \\| y | 400 | 10.0 | 20.0 | 0.50 |" in block and "fails: ImportError: no" in block


def test_block_diagram_is_what_its_script_draws(tmp_path):
    """docs/img/block.svg is scripts/diagram.py's drawing of today's knobs (its labels name real knobs only)."""
    diagram = load_script(ROOT / "scripts" / "diagram.py", "hf_tfm_diagram")
    svg, _ = diagram.main(["--out", str(tmp_path)])
    assert svg.read_bytes() == (DOCS / "img" / "block.svg").read_bytes(), "run python scripts/diagram.py"
