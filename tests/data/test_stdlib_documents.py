"""Whole standard-library docstrings for language modelling and retrieval, and their split."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from fedfm.data.stdlib_text import (
    MAX_CHARACTERS,
    TASK_FAMILIES,
    Document,
    documents_by_group,
    group_of,
    split_documents,
    stdlib_docstrings,
    stdlib_documents,
    stdlib_root,
)
from fedfm.errors import DataError


def test_documents_are_whole_with_line_breaks_and_the_cut_view_is_unchanged(
    tmp_path: Path,
) -> None:
    long = "Return the value.\n\n    More:\n        indented line   \n    " + "word " * 150
    (tmp_path / "shutil.py").write_text(f'def f():\n    """{long}"""\n')
    (tmp_path / "tool.py").write_text('"""Too short here."""\n')
    (documents,) = stdlib_documents(tmp_path)
    assert documents.group == "files" and documents.module == "shutil"
    assert documents.text.startswith("Return the value.\n\nMore:\n    indented line\nword")
    assert len(documents.text) > MAX_CHARACTERS  # not cut
    (cut,) = stdlib_docstrings(tmp_path)
    assert cut.text.startswith("Return the value. More: indented line word")
    assert len(cut.text) == MAX_CHARACTERS


def _fake(groups: dict[str, int]) -> list[Document]:
    """Per group, that many modules of 3 documents of various lengths."""
    return [
        Document(f"{group}.m{module}", f"f{index}", group, "x" * (50 + 37 * module + index))
        for group, modules in groups.items()
        for module in range(modules)
        for index in range(3)
    ]


def test_split_holds_out_whole_modules_per_group_seeded() -> None:
    documents = _fake({"files": 30, "numbers": 2, "public": 60})
    split = split_documents(documents, seed=3, held_out_fraction=0.1)
    train_modules = {d.module for d in split.train}
    assert not train_modules & split.held_out_modules()
    assert len(split.train) + len(split.held_out) == len(documents)
    size: Counter[str] = Counter()
    held: Counter[str] = Counter()
    for document in documents:
        size[document.group] += len(document.text)
    for document in split.held_out:
        held[document.group] += len(document.text)
    for group in ("files", "public"):
        assert 0.1 <= held[group] / size[group] <= 0.15
    # a group of two modules holds one out only if it fits within 1.5x of the fraction: not here
    assert held["numbers"] == 0 and any(d.group == "numbers" for d in split.train)
    assert split_documents(documents, seed=3) == split
    assert split_documents(documents, seed=4).held_out_modules() != split.held_out_modules()
    with pytest.raises(DataError, match="held_out_fraction"):
        split_documents(documents, held_out_fraction=1.0)


def test_real_documents_group_by_family() -> None:
    documents = stdlib_documents(stdlib_root() / "json")
    assert documents and all(d.group == "public" for d in documents)  # json's own modules
    assert group_of("asyncio.tasks") == "concurrency" and group_of("tkinter.ttk") == "ood"
    mixed = [*documents[:2], Document("http.client", "f", group_of("http.client"), "text")]
    groups = documents_by_group(mixed)
    assert list(groups) == ["public", "networking"] and len(groups["public"]) == 2
    assert set(groups) <= {*TASK_FAMILIES, "ood", "public"}
