"""The docs site (issue 42 section 3): ``mkdocs build --strict`` of mkdocs.yml (docs/ and the docstrings, through
mkdocstrings) into a temporary directory, offline. A broken link, a missing anchor, a page left out of the nav or an
object the API pages cannot resolve fails the build; the tests then check what it rendered: every page of docs/,
every public name of the packages with its docstring. docs/cli.md is checked against ``oarlock --help``."""

from __future__ import annotations

import contextlib
import html
import importlib
import inspect
import io
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CONFIG = REPO / "mkdocs.yml"
PACKAGES = ("checkpoint", "attention", "memory", "debug", "models")


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    r = _mkdocs_build(CONFIG, out)
    seconds = time.monotonic() - t0
    assert r.returncode == 0, f"strict build failed after {seconds:.1f} s:\n{r.stderr[-6000:]}"
    assert "WARNING" not in r.stderr, r.stderr[-6000:]
    assert seconds < 300, seconds  # a few seconds on an idle machine; far beyond means something changed
    return out


def _nav_files(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    return [f for value in nav.values() for f in _nav_files(value)]


def _text(page: str) -> str:
    """The visible text of an HTML page, whitespace folded (none left before a comma or a closing bracket, where
    an inline tag ended)."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())
    return re.sub(r"\( ", "(", re.sub(r" ([,.;:)])", r"\1", text))


def test_every_docs_page_is_in_the_nav_and_rendered(site):
    config = yaml.safe_load(CONFIG.read_text())
    nav = _nav_files(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, set(nav) ^ set(pages)
    for page in pages:
        out = site / page.replace(".md", ".html")
        assert out.is_file(), page
        title = next(line[2:] for line in (DOCS / page).read_text().splitlines() if line.startswith("# "))
        h1 = re.search(r"<h1[^>]*>(.*?)</h1>", out.read_text(), re.S)
        assert h1, page
        rendered = html.unescape(re.sub(r"<[^>]+>", "", h1.group(1))).replace("\u00b6", "")  # the permalink mark
        assert " ".join(rendered.split()) == " ".join(title.replace("`", "").split()), page
        assert len(_text(out.read_text())) > len((DOCS / page).read_text()) / 4, page  # the body, not a stub


def _ids(page: Path) -> set[str]:
    return set(re.findall(r'id="(oarlock\.[\w.]+)"', page.read_text()))


@pytest.mark.parametrize("package", PACKAGES)
def test_api_page_documents_every_public_name(site, package):
    """Each name of the package's ``__all__`` has its heading, at the package path, or, for a function named like
    the module that defines it (``oarlock.debug.capture``), at that module's path, the function and not the
    module; nothing else of the package is documented at the top level."""
    mod = importlib.import_module(f"oarlock.{package}")
    ids = _ids(site / "api" / f"{package}.html")
    submodules = {m.name for m in pkgutil.iter_modules(mod.__path__)}
    for name in mod.__all__:
        if name in submodules:
            assert f"oarlock.{package}.{name}.{name}" in ids, name
            assert not [i for i in ids if i.startswith(f"oarlock.{package}.{name}.")
                        and not i.startswith(f"oarlock.{package}.{name}.{name}")], name  # not the whole module
        else:
            assert f"oarlock.{package}.{name}" in ids, name
    top = {i.split(".")[2] for i in ids if i.count(".") == 2}
    assert top <= set(mod.__all__), top - set(mod.__all__)


def _opening(obj, words: int = 12) -> str:
    """The first words of an object's docstring as rendered: ``code`` and :role:`target` lose their markup (roles
    and markup further on render differently; the opening words do not)."""
    para = " ".join(inspect.getdoc(obj).split("\n\n")[0].split())
    para = re.sub(r":\w+:`~?([^`]*)`", r"\1", re.sub(r"``([^`]*)``", r"\1", para))
    return " ".join(para.split()[:words])


def test_api_pages_hold_the_docstrings(site):
    import oarlock.attention
    import oarlock.checkpoint

    text = _text((site / "api" / "checkpoint.html").read_text())
    for obj in (oarlock.checkpoint.save_state_dict, oarlock.checkpoint.load_state_dict,
                oarlock.checkpoint.CheckpointManager, oarlock.checkpoint.reshard_state_dict):
        assert _opening(obj) in text, (obj.__name__, _opening(obj))
    # the load's parameters as a table, and its Raises section whole (griffe dropped entries it could not parse)
    assert "verify_checksums" in text and "comm_method" in text
    assert "Every rank raises alike; no target is written before the whole plan is built and validated." in text
    attention = _text((site / "api" / "attention.html").read_text())
    assert _opening(oarlock.attention.flashmask_attention, 8) in attention


def test_the_search_index_covers_the_pages(site):
    index = (site / "search" / "search_index.json").read_text()
    for needle in ("checkpoint-guide.html", "api/checkpoint.html", "save_state_dict", "All in One Arrow"):
        assert needle in index, needle


BROKEN = {
    "missing page": ({"index.md": "# Home\n\nSee [the other page](other.md).\n"}, ["index.md"], "other.md"),
    "missing anchor": ({"index.md": "# Home\n\n[there](b.md#nowhere)\n", "b.md": "# B\n\n## Somewhere\n"},
                       ["index.md", "b.md"], "nowhere"),
    "page left out of the nav": ({"index.md": "# Home\n", "stray.md": "# Stray\n"}, ["index.md"], "stray.md"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_the_strict_settings_fail_the_build(tmp_path, case):
    """mkdocs.yml's own strictness (``strict`` and ``validation``), on a small site without the API plugin: a broken
    link, a missing anchor and a page left out of the nav each fail the build, naming what is wrong."""
    pages, nav, named = BROKEN[case]
    config = yaml.safe_load(CONFIG.read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in pages.items():
        (docs / name).write_text(text)
    small = {key: config[key] for key in ("site_name", "strict", "validation", "markdown_extensions", "theme")}
    small.update(docs_dir="docs", nav=nav, plugins=[])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    r = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0, r.stderr
    assert named in r.stderr, r.stderr[-3000:]
    good = _mkdocs_build_fixed(tmp_path, pages, nav)
    assert good.returncode == 0, good.stderr[-3000:]


def _mkdocs_build_fixed(tmp_path: Path, pages: dict[str, str], nav: list[str]) -> subprocess.CompletedProcess:
    """The same small site with the fault removed builds: what failed was the fault, not the set-up."""
    docs = tmp_path / "docs"
    for name in pages:
        text = (docs / name).read_text()
        (docs / name).write_text(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text))  # links dropped
    config = yaml.safe_load((tmp_path / "mkdocs.yml").read_text())
    config["nav"] = sorted(pages, key=lambda n: n != "index.md")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site-fixed")


def _help(*args: str) -> str:
    """``oarlock ARGS --help`` as printed, run in this process (the entry point, torch imported once)."""
    from oarlock.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0, args
    return out.getvalue()


def _subcommands(help_text: str) -> list[str]:
    if "positional arguments:" not in help_text:
        return []
    listing = help_text.split("positional arguments:", 1)[1].split("\noptions:", 1)[0]
    return re.findall(r"^    ([a-z][\w-]*)", listing, re.M)


def test_cli_page_covers_every_command_with_real_options():
    """docs/cli.md has a section per command of ``oarlock --help``, and every ``--option`` a section names is an
    option of that command (or of one of its subcommands), so the page cannot drift from the parser."""
    cli = (DOCS / "cli.md").read_text()
    sections = dict(re.findall(r"^## `oarlock ([a-z-]+)[^`\n]*`\n(.*?)(?=^## |\Z)", cli, re.S | re.M))
    commands = _subcommands(_help())
    assert sorted(sections) == sorted(commands)
    checked = 0
    for command, body in sections.items():
        text = _help(command)
        subs = _subcommands(text)
        for sub in subs:
            assert f"oarlock {command} {sub}" in body, (command, sub)  # each subcommand is described
            text += _help(command, sub)
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", body)):
            assert re.search(rf"(?<![\w-]){flag}\b", text), (command, flag)
            checked += 1
    assert checked >= 40, checked
