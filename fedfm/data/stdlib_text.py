"""Real text that ships with Python: standard-library docstrings, labelled by module family.

Every docstring of a module, class or function in the standard library's ``.py`` sources (read
with :mod:`ast`, nothing imported or executed) becomes one text, whitespace-normalised and cut
at :data:`MAX_CHARACTERS`; texts shorter than :data:`MIN_WORDS` words and duplicates are
dropped. Test suites (``test``, ``tests``, ``idle_test`` folders) and ``site-packages`` are
left out.

Splits (disjoint, by module):

* **task**: :data:`TASK_FAMILIES`, seven families of modules (files, networking, concurrency,
  numbers, text processing, testing and debugging, data structures); the label is the family.
  Per family, a seeded draw gives the provider's training set and the client's queries.
* **OOD**: :data:`OOD_MODULES`, GUI and terminal code (tkinter, IDLE, turtle, curses): text about
  widgets and windows, a domain none of the families covers.
* **public** (``D_pub``): every other module (argparse, logging, importlib, sqlite3, xml ...
  minus the families): real text from the same library, but about other topics, like the
  paper's Wikipedia/IMDB for its tasks.

The draw depends on the seed and on the Python version's sources (recorded with results).

**Documents** (:func:`stdlib_documents`, :func:`split_documents`): the same docstrings whole, for
language modelling and retrieval: dedented with their line breaks, not cut at
:data:`MAX_CHARACTERS`, each with its group (a task family, ``ood`` or ``public``, see
:func:`group_of`). :func:`split_documents` holds out whole modules, a seeded draw per group, so
held-out text shares no module with the training text (a docstring's siblings in one module are
often near-copies); every group keeps training documents.
"""

from __future__ import annotations

import ast
import functools
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedfm.errors import DataError

MAX_CHARACTERS = 600
MIN_WORDS = 6
TASK_FAMILIES: dict[str, tuple[str, ...]] = {
    "files": (
        "os", "pathlib", "shutil", "glob", "fnmatch", "tempfile", "zipfile", "tarfile",
        "filecmp", "fileinput", "gzip", "bz2", "lzma", "stat", "genericpath", "posixpath",
        "ntpath",
    ),
    "networking": (
        "http", "urllib", "email", "smtplib", "imaplib", "poplib", "ftplib", "socket", "ssl",
        "socketserver", "xmlrpc", "mailbox", "nntplib", "smtpd", "wsgiref", "mimetypes",
    ),
    "concurrency": (
        "asyncio", "concurrent", "threading", "multiprocessing", "queue", "sched", "selectors",
        "subprocess", "_threading_local", "asynchat", "asyncore",
    ),
    "numbers": ("_pydecimal", "fractions", "statistics", "random", "numbers", "colorsys"),
    "text": (
        "re", "sre_parse", "sre_compile", "string", "textwrap", "difflib", "csv",
        "configparser", "shlex", "gettext", "locale", "html", "_markupbase", "stringprep",
        "json", "xml", "tokenize", "pprint", "reprlib", "codecs", "base64", "quopri",
    ),
    "testing": (
        "unittest", "doctest", "pdb", "bdb", "trace", "profile", "cProfile", "pstats", "timeit",
        "traceback",
    ),
    "structures": (
        "collections", "_collections_abc", "functools", "heapq", "bisect", "copy", "dataclasses",
        "enum", "typing", "abc", "_py_abc", "weakref", "_weakrefset", "contextlib", "graphlib",
    ),
}  # fmt: skip
OOD_MODULES = ("tkinter", "idlelib", "turtle", "turtledemo", "curses")
EXCLUDED = ("test", "site-packages", "__phello__", "__hello__", "antigravity", "this")


@dataclass(frozen=True)
class Docstring:
    """One docstring: the module it comes from, the documented object, the text."""

    module: str
    name: str
    text: str


def stdlib_root() -> Path:
    """The folder of this interpreter's standard-library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise DataError(f"the standard library's sources are not under {root}")
    return root


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()[:MAX_CHARACTERS]


def _documented(tree: ast.Module) -> Iterator[tuple[str, str]]:
    yield "<module>", ast.get_docstring(tree) or ""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, ast.get_docstring(node) or ""


def stdlib_docstrings(root: Path | None = None) -> list[Docstring]:
    """Every usable docstring of the standard library, sorted by module and position (parsed
    once per process and folder)."""
    return list(_parse_docstrings(root or stdlib_root()))


@functools.cache
def _raw_docstrings(root: Path) -> tuple[Docstring, ...]:
    """Every docstring as :func:`ast.get_docstring` gives it (dedented), in source order: the
    one parse both views below share."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in EXCLUDED or any(part in {"test", "tests", "idle_test"} for part in parts):
            continue
        module = ".".join(part for part in parts if part != "__init__")
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # lib2to3 test data and the like
            continue
        found += [Docstring(module, name, raw) for name, raw in _documented(tree) if raw]
    if not found:
        raise DataError(f"no docstrings found under {root}")
    return tuple(found)


@functools.cache
def _parse_docstrings(root: Path) -> tuple[Docstring, ...]:
    found, seen = [], set()
    for item in _raw_docstrings(root):
        text = _clean(item.text)
        if len(text.split()) >= MIN_WORDS and text not in seen:
            seen.add(text)
            found.append(Docstring(item.module, item.name, text))
    if not found:
        raise DataError(f"no docstrings found under {root}")
    return tuple(found)


def family_of(module: str) -> str | None:
    """The task family of ``module`` (by its top-level name), or ``None``."""
    top = module.split(".")[0]
    return next((name for name, tops in TASK_FAMILIES.items() if top in tops), None)


def is_ood(module: str) -> bool:
    return module.split(".")[0] in OOD_MODULES


@dataclass(frozen=True)
class LabelledTexts:
    texts: list[str]
    labels: np.ndarray  # int64 class indices into HelixData.classes


@dataclass(frozen=True)
class HelixData:
    """The four disjoint splits: public, the provider's training set, queries, OOD."""

    classes: tuple[str, ...]
    public: list[str]
    train: LabelledTexts
    queries: LabelledTexts
    ood: list[str]


def _draw(rng: np.random.Generator, items: list[str], count: int, what: str) -> list[str]:
    if len(items) < count:
        raise DataError(f"{what} has {len(items)} docstrings, {count} requested")
    return [items[i] for i in sorted(rng.choice(len(items), size=count, replace=False))]


def build_splits(
    *,
    seed: int = 0,
    public_size: int = 2048,
    train_per_class: int = 200,
    queries_per_class: int = 100,
    ood_size: int = 700,
    docstrings: list[Docstring] | None = None,
) -> HelixData:
    """A seeded draw of the splits of the module docstring; :class:`DataError` if a split has
    fewer docstrings than requested."""
    docstrings = stdlib_docstrings() if docstrings is None else docstrings
    rng = np.random.default_rng(seed)
    classes = tuple(TASK_FAMILIES)
    by_family: dict[str, list[str]] = {name: [] for name in classes}
    public, ood = [], []
    for item in docstrings:
        family = family_of(item.module)
        if family is not None:
            by_family[family].append(item.text)
        elif is_ood(item.module):
            ood.append(item.text)
        else:
            public.append(item.text)
    train_texts, train_labels, query_texts, query_labels = [], [], [], []
    for label, name in enumerate(classes):
        drawn = _draw(rng, by_family[name], train_per_class + queries_per_class, f"family {name}")
        order = rng.permutation(len(drawn))
        train_texts += [drawn[i] for i in order[:train_per_class]]
        query_texts += [drawn[i] for i in order[train_per_class:]]
        train_labels += [label] * train_per_class
        query_labels += [label] * queries_per_class
    return HelixData(
        classes=classes,
        public=_draw(rng, public, public_size, "the public split"),
        train=LabelledTexts(train_texts, np.asarray(train_labels, dtype=np.int64)),
        queries=LabelledTexts(query_texts, np.asarray(query_labels, dtype=np.int64)),
        ood=_draw(rng, ood, ood_size, "the OOD split"),
    )


# ---------------------------------------------------------------------------------------------
# Whole documents: language modelling and retrieval
# ---------------------------------------------------------------------------------------------

OOD_GROUP = "ood"
PUBLIC_GROUP = "public"
HELD_OUT_FRACTION = 0.1


@dataclass(frozen=True)
class Document:
    """One whole docstring: its module, the documented object, its group, the text.

    ``group`` is the task family of the module (a key of :data:`TASK_FAMILIES`), ``ood`` for
    GUI and terminal code, or ``public`` for every other module (:func:`group_of`).
    """

    module: str
    name: str
    group: str
    text: str


def group_of(module: str) -> str:
    """The group of ``module``: its task family, :data:`OOD_GROUP` or :data:`PUBLIC_GROUP`."""
    family = family_of(module)
    if family is not None:
        return family
    return OOD_GROUP if is_ood(module) else PUBLIC_GROUP


def _whole(text: str) -> str:
    # Keep line breaks and indentation (doctest examples, lists); drop trailing blanks and runs
    # of empty lines.
    text = re.sub(r"[ \t]+\n", "\n", text.strip())
    return re.sub(r"\n{3,}", "\n\n", text)


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """Every usable docstring of the standard library whole (module docstring), in source order.

    The same docstrings as :func:`stdlib_docstrings` (at least :data:`MIN_WORDS` words,
    duplicates dropped) but not cut and with their line breaks.
    """
    found, seen = [], set()
    for item in _raw_docstrings(root or stdlib_root()):
        text = _whole(item.text)
        if len(text.split()) >= MIN_WORDS and text not in seen:
            seen.add(text)
            found.append(Document(item.module, item.name, group_of(item.module), text))
    return found


@dataclass(frozen=True)
class DocumentSplit:
    """Training and held-out documents; no module has documents on both sides."""

    train: tuple[Document, ...]
    held_out: tuple[Document, ...]

    def held_out_modules(self) -> set[str]:
        return {document.module for document in self.held_out}


def split_documents(
    documents: list[Document] | None = None,
    *,
    seed: int = 0,
    held_out_fraction: float = HELD_OUT_FRACTION,
) -> DocumentSplit:
    """Hold out whole modules: per group, a seeded order of its modules, taken while the held-out
    characters stay within 1.5x of ``held_out_fraction`` of the group's, until they reach it.

    Modules too large to fit are skipped, so a group of a few large modules may hold out less
    than the fraction (never more than 1.5x of it); every group keeps at least one training
    module. The seed is public: the split is a data split, not a secret.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise DataError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    documents = stdlib_documents() if documents is None else documents
    sizes: dict[str, dict[str, int]] = {}
    for document in documents:
        modules = sizes.setdefault(document.group, {})
        modules[document.module] = modules.get(document.module, 0) + len(document.text)
    rng = np.random.default_rng(seed)
    held: set[str] = set()
    for group in sorted(sizes):
        names = sorted(sizes[group])
        target = held_out_fraction * sum(sizes[group].values())
        taken = 0
        for index in rng.permutation(len(names)):
            module = names[index]
            if taken >= target:
                break
            if taken + sizes[group][module] <= 1.5 * target and len(names) > 1:
                held.add(module)
                taken += sizes[group][module]
        if all(module in held for module in names):  # keep one module for training
            held.discard(names[0])
    return DocumentSplit(
        train=tuple(d for d in documents if d.module not in held),
        held_out=tuple(d for d in documents if d.module in held),
    )


def documents_by_group(
    documents: tuple[Document, ...] | list[Document],
) -> dict[str, list[Document]]:
    """``documents`` by group (task family, ``ood``, ``public``), in their order: e.g. to give
    each context owner of a retrieval protocol different families."""
    groups: dict[str, list[Document]] = {}
    for document in documents:
        groups.setdefault(document.group, []).append(document)
    return groups
