"""The docs site builds with warnings as errors: a broken link, a missing anchor or page, or
a docstring mkdocstrings cannot render fails the build, and this test shows mkdocs' output.

The build runs in this process (mkdocs' Python API), with the settings of ``mkdocs.yml``
and ``strict`` on, as ``mkdocs build --strict`` does; mkdocstrings reads the docstrings
statically (griffe), so nothing here imports torch, TensorFlow or Horovod.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

mkdocs_config = pytest.importorskip("mkdocs.config", reason="mkdocs is not installed "
                                    "(scripts/install.sh installs it with the test tools)")
from mkdocs.commands.build import build  # noqa: E402
from mkdocs.exceptions import Abort  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """Collect every record mkdocs and its plugins log at INFO or above, as text."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname}: {record.getMessage()}")

    handler = Collect(logging.INFO)
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def build_site(config_file: Path, site_dir: Path) -> tuple[bool, list[str]]:
    """Build ``config_file`` strictly into ``site_dir``; return (succeeded, log lines)."""
    config = mkdocs_config.load_config(config_file=str(config_file), site_dir=str(site_dir),
                                       strict=True)
    with captured_log() as lines:
        try:
            config.plugins.on_startup(command="build", dirty=False)
            try:
                build(config)
            finally:
                config.plugins.on_shutdown()
        except Abort as error:
            lines.append(f"ABORT: {error}")
            return False, lines
    return True, lines


def warnings_of(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("WARNING", "ERROR", "ABORT"))]


def test_site_builds_strict(tmp_path: Path) -> None:
    ok, lines = build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    assert ok and not warnings_of(lines), "mkdocs build --strict failed:\n" + "\n".join(lines)
    for page in ("user-guide", "schemes", "parameter-server", "benchmarks", "design",
                 "contributing", "api/torch"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def docs_links_in_code() -> set[tuple[str, str]]:
    """Every ``docs/<page>.md[#anchor]`` the library, the server and the scripts mention."""
    found: set[tuple[str, str]] = set()
    for top in ("hvd_compress", "ps_server", "scripts", "examples"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".sh") and path.is_file():
                text = path.read_text(errors="replace")
                for page, anchor in re.findall(r"docs/([\w/.-]+?)\.md(?:#([\w-]+))?", text):
                    found.add((page, anchor))
    return found


def test_docs_links_in_the_code_resolve(tmp_path: Path) -> None:
    """A docstring's link to a docs page (and anchor) names one the site has."""
    ok, lines = build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    assert ok, "\n".join(lines)
    missing = []
    for page, anchor in sorted(docs_links_in_code()):
        if page.startswith("results/"):
            continue
        html = tmp_path / "site" / page.removesuffix("index") / "index.html"
        if not html.is_file():
            missing.append(f"docs/{page}.md")
        elif anchor and f'id="{anchor}"' not in html.read_text():
            missing.append(f"docs/{page}.md#{anchor}")
    assert not missing, f"links in the code to docs pages or anchors that do not exist: {missing}"


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The same validation settings as mkdocs.yml, on two pages with one fault each."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide.md#no-such-part).\n")
    (docs / "guide.md").write_text("# Guide\n\n## Usage\n\nSee [missing](missing.md).\n")
    real = (ROOT / "mkdocs.yml").read_text()
    validation = real[real.index("validation:"):real.index("markdown_extensions:")]
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\ndocs_dir: docs\nnav:\n  - index.md\n  - guide.md\n" + validation)
    ok, lines = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    found = "\n".join(warnings_of(lines))
    assert not ok, "a build with broken links succeeded:\n" + "\n".join(lines)
    assert "missing.md" in found and "no-such-part" in found, found
