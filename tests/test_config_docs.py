"""README.md's Config table is the Config's own documentation: every field, its true default, its
meaning as config.py writes it, and nothing else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import zpp_compile
from zpp_compile.config import _shown_default, config_table_markdown

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_config_table() -> list[tuple[str, str, str]]:
    """(field, default, meaning) of each row of README's table headed `| field | default | meaning |`."""
    lines = README.read_text().splitlines()
    start = lines.index("| field | default | meaning |")
    assert re.fullmatch(r"\|( -+ \|)+", lines[start + 1]), "the header is followed by its separator row"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a Config row has three cells: {line}"
        rows.append((cells[0], cells[1], cells[2]))
    return rows


def test_readme_lists_every_config_field_with_its_default_and_nothing_else():
    rows = readme_config_table()
    names = [name for name, _, _ in rows]
    fields = [f"`{f.name}`" for f in dataclasses.fields(zpp_compile.Config)]
    assert sorted(names) == sorted(fields), (
        f"README lacks {sorted(set(fields) - set(names))}, lists unknown {sorted(set(names) - set(fields))}"
    )
    assert len(names) == len(set(names)), "a field listed twice"
    defaults = {f"`{f.name}`": f.default for f in dataclasses.fields(zpp_compile.Config)}
    for name, shown, _ in rows:
        assert shown == _shown_default(defaults[name]), (
            f"README's default of {name} is {shown}, Config's {defaults[name]!r}"
        )


def test_readme_table_is_written_from_config_py():
    expected = config_table_markdown()
    actual = "\n".join(
        ["| field | default | meaning |", "| --- | --- | --- |"]
        + [f"| {name} | {default} | {meaning} |" for name, default, meaning in readme_config_table()]
    )
    assert actual == expected, (
        "README's Config table differs from config.py's field documentation; paste in "
        "zpp_compile.config.config_table_markdown()"
    )


@pytest.mark.parametrize("value, shown", [(None, "`None`"), (False, "`False`"), ("inductor", '`"inductor"`'),
                                          (256, "256"), (25 * 2**20, "25 MiB"), (50.0, "50")])  # fmt: skip
def test_defaults_are_shown_as_readme_writes_them(value, shown):
    assert _shown_default(value) == shown


def test_config_docstring_lists_every_field():
    doc = zpp_compile.Config.__doc__
    for f in dataclasses.fields(zpp_compile.Config):
        assert f.metadata["doc"], f"Config.{f.name} has no documentation"
        assert f"        {f.name} (default {f.default!r}): " in doc


def test_readme_cites_no_issue_numbers():
    assert not re.search(r"\b[Ii]ssues? #?\d+", README.read_text()), "README must not cite issue numbers"
