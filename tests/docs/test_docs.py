"""The docs stay true to the code.

- Every --backend-config key and every CLI flag has a description, and the generated reference pages
  (docs/reference/*.md, `python -m skyrl_tx.docs_gen docs/reference`) equal what the code generates now.
- The README's relative links reach existing docs pages and headings (mkdocs build --strict checks the site's own
  links; tests/run_all.sh runs it).
- The Python blocks marked `<!-- run -->` in README.md and docs/*.md run against a live tiny-qwen3 server with
  deprecation FutureWarnings as errors (SDK 0.38 idioms), one subprocess each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_scripts import exited_cleanly
from live_server import ServerUrl, live_server

from skyrl_tx import docs_gen

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RUN_MARKER = "<!-- run -->"
BLOCK = re.compile(r"^<!-- run -->\s*\n```python\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_backend_config_key_has_a_description() -> None:
    assert docs_gen.undocumented_backend_keys() == [], (
        "describe these --backend-config keys in BACKEND_CONFIG_DOCS (skyrl_tx/backend_config_docs.py), then run "
        "`python -m skyrl_tx.docs_gen docs/reference`")
    assert docs_gen.stale_backend_docs() == [], "BACKEND_CONFIG_DOCS names keys BackendSettings no longer has"


def test_every_cli_flag_has_help_text() -> None:
    assert docs_gen.undocumented_cli_flags() == [], "give these arguments a help= text (skyrl_tx/cli.py)"


@pytest.mark.parametrize("name", ["backend-config.md", "cli.md", "http-api.md"])
def test_generated_reference_pages_are_up_to_date(name: str) -> None:
    generate = {"backend-config.md": docs_gen.backend_config_page, "cli.md": docs_gen.cli_page,
                "http-api.md": docs_gen.http_api_page}[name]
    path = DOCS / "reference" / name
    assert path.is_file() and path.read_text() == generate(), (
        f"{path.relative_to(REPO)} is out of date: run `python -m skyrl_tx.docs_gen docs/reference` and commit it")


def _slugify(heading: str) -> str:
    """Python-Markdown's toc slugify (what MkDocs names a heading's anchor)."""
    ascii_text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower())


def _anchors(markdown: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return {_slugify(re.sub(r"[`*]", "", m.group(1)).strip()) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_readme_links_reach_docs_pages_and_headings() -> None:
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 200, "the README stays short: move detail into docs/"
    broken = []
    for target in LINK.findall(readme):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = REPO / path if path else REPO / "README.md"
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert broken == [], f"README.md links to missing pages or headings: {broken}"


def runnable_blocks() -> list[tuple[str, str]]:
    """(where, code) of every `<!-- run -->` Python block, each distinct block once (the README repeats the
    getting-started page's first call)."""
    seen: dict[str, str] = {}
    for path in [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[:match.start()].count("\n") + 1
            seen.setdefault(match.group(1), f"{path.relative_to(REPO)}:{line}")
        assert len(re.findall(rf"^{RUN_MARKER}", text, re.M)) == len(BLOCK.findall(text)), (
            f"{path}: a {RUN_MARKER} marker must come right before a ```python block")
    return [(where, code) for code, where in seen.items()]


def test_every_python_example_runs() -> None:
    """Every ```python block of the site and the README is marked to run (and so runs below against a live
    server): an example that needs context it does not build itself would go stale unseen."""
    blocks = runnable_blocks()
    assert any(where.startswith("docs/getting-started.md") for where, _ in blocks)
    for path in [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]:
        text = path.read_text()
        assert text.count("```python") == len(BLOCK.findall(text)), f"{path}: a ```python block without {RUN_MARKER}"


@pytest.fixture(scope="module")
def docs_server(preset_cache: Path) -> Iterator[ServerUrl]:
    with live_server(base_model="tiny-qwen3") as url:
        yield url


@pytest.mark.parametrize("where,code", runnable_blocks(), ids=[where for where, _ in runnable_blocks()])
def test_runnable_block_runs_against_a_live_server(docs_server: ServerUrl, preset_cache: Path, where: str,
                                                   code: str) -> None:
    env = {**os.environ, "TINKER_BASE_URL": docs_server, "TINKER_API_KEY": "tml-docs", "TINKER_TELEMETRY": "0",
           "SKYRL_TX_CACHE_DIR": str(preset_cache)}
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-W", "error::FutureWarning", "-c", code],
                            env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    output = f"{where}\nstdout:\n{result.stdout}\nstderr (tail):\n{result.stderr[-4000:]}"
    assert exited_cleanly(result.returncode, result.stderr), output
    assert "FutureWarning" not in result.stderr, output


def test_start_up_output_is_one_line_per_stage(docs_server: ServerUrl) -> None:
    """Issue 41 item 5: a newcomer reads the server's start-up as one line per stage (database, listening with the
    docs URL, threads, memory plan, model loaded with its size and device, engine ready), without Alembic's per-plugin
    and per-migration INFO lines or a progress bar."""
    text = docs_server.log_path.read_text()
    head = text[:text.index("engine ready")]
    assert "alembic" not in head and "Writing model shards" not in head, head
    for stage in ("skyrl_tx.api: database: ", " at revision ", "listening on http://", "/docs)", "threads: intra-op",
                  "memory plan (skyrl-tx plan", "model loaded: ", " parameters, ", " weights on cpu"):
        assert head.count(stage) == 1, (stage, head)
