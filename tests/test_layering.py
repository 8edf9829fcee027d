"""docs/architecture.md's layering, enforced: every import in `tandem/` between packages is one the table there
allows (its `may import` column), and the table allows only lower layers plus the cross-imports it lists. The
rules are read from the doc, so the doc and the code cannot drift apart."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
ROOT = "tandem"
NAME = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Row:
    layer: int  # 0 for the first layer of the table, counting up
    packages: tuple[str, ...]
    may_import: tuple[str, ...]


@dataclass(frozen=True)
class Import:
    where: str  # file:line
    module: str  # absolute, relative imports resolved


def read_table(text: str) -> list[Row]:
    """The table whose header has `may import`: layers in the order they first appear, bottom up."""
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("|") and "may import" in line:
            header = [cell.strip() for cell in line.strip().strip("|").split("|")]
            break
    else:
        raise AssertionError(f"{DOC}: no table with a `may import` column")
    next(lines)  # the |---| line
    layers: list[str] = []
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (cell.strip() for cell in line.strip().strip("|").split("|")), strict=False))
        if cells["layer"] not in layers:
            layers.append(cells["layer"])
        rows.append(Row(layers.index(cells["layer"]), tuple(NAME.findall(cells["package"])),
                        tuple(NAME.findall(cells["may import"]))))
    return rows


def read_cross_imports(text: str) -> set[tuple[str, str]]:
    """The list after "Allowed cross-imports": `- `importer` → `name`, `name`: why`."""
    section = text[text.index("Allowed cross-imports"):]
    allowed = set()
    for item in re.findall(r"^- (`[^\n]*?`)\s*:", section, re.M):
        importer, _, targets = item.partition("→")
        (importer,) = NAME.findall(importer)
        allowed |= {(importer, target) for target in NAME.findall(targets)}
    return allowed


def covers(entry: str, module: str) -> bool:
    """`tandem` names only the package's own `__init__.py`; any other entry also covers what is under it."""
    return module == entry or (entry != ROOT and module.startswith(entry + "."))


def row_of(rows: list[Row], module: str) -> Row | None:
    """The row of the most specific package holding `module`."""
    best: tuple[int, Row] | None = None
    for row in rows:
        for package in row.packages:
            if covers(package, module) and (best is None or len(package) > best[0]):
                best = len(package), row
    return best[1] if best else None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[Import]:
    """Every import in the file, at any depth (functions, `if TYPE_CHECKING:`), of a `tandem` module."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    where = lambda node: f"{path.relative_to(REPO)}:{node.lineno}"  # noqa: E731
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(where(node), alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from tandem.x import y` may name a module y: the import is of `tandem.x.y` then
            found += [Import(where(node), f"{name}.{alias.name}" if _is_module(f"{name}.{alias.name}") else name)
                      for alias in node.names]
    return [i for i in dict.fromkeys(found) if i.module == ROOT or i.module.startswith(ROOT + ".")]


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted((REPO / ROOT).rglob("*.py"))


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def rows(doc: str) -> list[Row]:
    return read_table(doc)


def test_the_table_is_read(rows: list[Row], doc: str) -> None:
    packages = {package for row in rows for package in row.packages}
    assert {"tandem.runtime", "tandem.llm", "tandem.frontend", "tandem.router", "tandem.worker",
            "tandem.vllm", "tandem.launch"} <= packages
    assert len({row.layer for row in rows}) >= 4
    assert ("tandem.frontend", "tandem.router") in read_cross_imports(doc)


def test_every_module_has_a_row(rows: list[Row]) -> None:
    missing = [str(path.relative_to(REPO)) for path in sources() if row_of(rows, module_name(path)) is None]
    assert not missing, "modules of no package in docs/architecture.md's table (add a row):\n" + "\n".join(missing)


def test_the_table_allows_only_lower_layers_and_the_listed_cross_imports(rows: list[Row], doc: str) -> None:
    cross = read_cross_imports(doc)
    wrong = []
    for row in rows:
        for entry in row.may_import:
            target = row_of(rows, entry)
            if target is None:
                wrong.append(f"{row.packages[0]} may import {entry}: a package the table does not have")
            elif target.layer >= row.layer and not any((package, entry) in cross for package in row.packages):
                wrong.append(f"{row.packages[0]} may import {entry}, which is not on a lower layer and not an "
                             "allowed cross-import")
    listed = {(package, entry) for row in rows for package in row.packages for entry in row.may_import}
    wrong += [f"the cross-import {importer} → {target} is not in the table's `may import`"
              for importer, target in sorted(cross - listed)]
    assert not wrong, "docs/architecture.md contradicts itself:\n" + "\n".join(wrong)


def test_imports_follow_the_layers(rows: list[Row]) -> None:
    offending = []
    for path in sources():
        row = row_of(rows, module_name(path))
        if row is None:
            continue  # test_every_module_has_a_row names it
        for found in imports_of(path):
            if row_of(rows, found.module) is row:
                continue  # within the package
            if not any(covers(entry, found.module) for entry in row.may_import):
                offending.append(f"{found.where} imports {found.module}")
    assert not offending, ("imports docs/architecture.md's table does not allow (its `may import` column; move the "
                           "shared code down a layer, or write the rule there):\n" + "\n".join(offending))


# -- the frontend's floors ----------------------------------------------------------------------------


def read_floors(text: str) -> dict[str, int]:
    """docs/architecture.md's table of the frontend's floors (header `floor | modules`), listed from the top:
    each module or folder (`frontend/api/`) -> its floor, 0 for the ground."""
    section = text[text.index("## The frontend's floors"):]
    section = section[:section.index("\n## ")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    floors = {}
    for height, line in enumerate(reversed(rows)):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for entry in NAME.findall(cells[1]):
            floors["tandem/" + entry] = height
    return floors


def floor_of(floors: dict[str, int], path: str) -> int | None:
    return next((floor for entry, floor in floors.items()
                 if path == entry or (entry.endswith("/") and path.startswith(entry))), None)


def api_of(path: str) -> str | None:
    """The API a module of `frontend/api/` belongs to: its package, or itself."""
    if not path.startswith("tandem/frontend/api/"):
        return None
    parts = path.removeprefix("tandem/frontend/api/").split("/")
    return parts[0].removesuffix(".py") if parts[0] != "__init__.py" else None


def _source_path(module: str) -> str:
    path = Path(*module.split("."))
    return str(path / "__init__.py") if (REPO / path / "__init__.py").is_file() else f"{path}.py"


def test_the_frontend_imports_down_its_floors(doc: str) -> None:
    floors = read_floors(doc)
    assert floor_of(floors, "tandem/frontend/protocol/errors.py") == 0 and floor_of(floors, "tandem/frontend/main.py")
    unplaced, offending = [], []
    for path in sorted((REPO / ROOT / "frontend").rglob("*.py")):
        here = str(path.relative_to(REPO))
        if here == "tandem/frontend/__init__.py":
            continue
        floor = floor_of(floors, here)
        if floor is None:
            unplaced.append(here)
            continue
        for found in imports_of(path):
            if not found.module.startswith("tandem.frontend."):
                continue
            target = _source_path(found.module)
            target_floor = floor_of(floors, target)
            if target_floor is None or target_floor > floor:
                offending.append(f"{found.where} imports {found.module}, a floor above")
            elif api_of(here) and api_of(target) and api_of(here) != api_of(target):
                offending.append(f"{found.where} imports {found.module}: an API imports no other API")
    assert not unplaced, "frontend modules on no floor of docs/architecture.md's table:\n" + "\n".join(unplaced)
    assert not offending, "imports against the frontend's floors:\n" + "\n".join(offending)
