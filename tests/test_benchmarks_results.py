"""benchmarks/_results.write_section: a benchmark's --append-results replaces its own section of RESULTS.md (which
shows today's figures) and keeps the replaced text in benchmarks/history/, leaving every other section as it was."""

from testkit import load_benchmark


def test_write_section_replaces_its_own_section_and_keeps_history(tmp_path):
    res = load_benchmark("_results")
    results = tmp_path / "RESULTS.md"
    before = "# Results\n\n## a.py: first\n\nold a\n\n## b.py: second\n\nold b\n"
    results.write_text(before)
    res.write_section("/x/benchmarks/a.py", "first", "| new | a |", results=results, history=tmp_path / "h")
    text = results.read_text()
    assert "old a" not in text and "| new | a |" in text
    assert text.index("## a.py: first") < text.index("| new | a |") < text.index("## b.py: second")
    assert text.endswith("## b.py: second\n\nold b\n")  # the other section byte-identical
    assert "load average" in text.split("## b.py")[0]
    hist = (tmp_path / "h" / "a.md").read_text()
    assert "## a.py: first (replaced " in hist and "old a" in hist
    res.write_section("c.py", "third", "new c", results=results, history=tmp_path / "h")
    assert results.read_text().rstrip().endswith("new c") and "## c.py: third" in results.read_text()
    assert not (tmp_path / "h" / "c.md").exists()  # nothing was replaced
