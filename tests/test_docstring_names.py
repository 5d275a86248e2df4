"""Every package name a docstring or comment gives (``tuning.preset.search``, ``scheduler.RoundLoop``,
``jobs/output.py``) exists: a renamed or deleted module or symbol leaves no sentence that sends the reader to it.

What is checked: each ``double-backquoted`` span of ``lp_runner/**/*.py`` (each `backquoted` span of
``docs/design.md``) that is a dotted name (``a.b``, ``a.b.c(...)``, ``a.b=value``) or a path ending ``.py``.
How a name resolves, first match wins:

- a config key: ``section.field`` of the config dataclasses (``lookahead.window_size``), or ``advanced.<name>``;
- a package name: a module path relative to ``lp_runner`` (``decoding.scheduler``), a module by its last part
  (``exchange.agree_batch``), or a module-level name of any package module (``RoundLoop.run``), followed by
  attributes: a module's own names (not what it imports, unless it is a package's ``__init__``) and
  submodules, a class's attributes, dataclass fields and ``self.<name>`` assignments;
- a conventional variable of the docs (``VARIABLES``: ``stats.collectives`` is ``GenerationStats.collectives``);
- a record key: ``run.device`` or ``policy.calibration.file``, a section of a record (``RECORD_SECTIONS``)
  followed by keys the package writes or reads (string constants and keyword names of its source);
- another importable top-level module (``torch.compile``, ``os.replace``): imported, then its attributes;
- a path: a file of the repository (from its root, from ``lp_runner/``, or the tail of one: ``exchange.py``).

Not names, so skipped: a span whose first part is a name of the enclosing function or class (a parameter, a
local, an attribute: ``feed.post``, ``worker.adapter``), ALL-CAPS placeholders (``OUT.lock``), file names with a
data extension (``records.jsonl``), and the handful of outside-library names in ``EXTERNAL`` (bare class names of
torch and transformers, written the way their own docs write them).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
from collections.abc import Iterator

import pytest
from dist_helpers import REPO

from lp_runner import config

PACKAGE = REPO / "lp_runner"
DESIGN = REPO / "docs" / "design.md"
# a dotted name and what may follow it inside the quotes (a call, an index, a value): ``a.b(x)``, ``a.b=on``
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\)|\[.*\]|\s*[=:<>].*)?")
PATH = re.compile(r"[\w./-]+\.py")
DATA_SUFFIXES = {"json", "jsonl", "bin", "md", "yaml", "yml", "txt", "csv", "png", "log", "so", "c", "h", "gguf"}
DATA_SUFFIXES |= {"safetensors", "pt", "lock", "new", "partial", "sh", "html", "gz", "tsv"}
# Outside-library names a docstring may use bare, as their own docs do; each maps to where it lives (resolved).
EXTERNAL = {
    "Tensor": "torch.Tensor",
    "nn": "torch.nn",
    "finfo": "torch.finfo",
    "mkldnn": "torch.ops.mkldnn",
    "DynamicCache": "transformers.DynamicCache",
    "GenerationMixin": "transformers.GenerationMixin",
    "PreTrainedModel": "transformers.PreTrainedModel",
    "F": "torch.nn.functional",
    "ErrorHandler": "torch.distributed.elastic.multiprocessing.errors.ErrorHandler",
}
# The names the docs give an object of one type throughout (``adapter.arena``): each a dotted path.
VARIABLES = {
    "model": "transformers.PreTrainedModel",
    "cfg": "lp_runner.config.Config",
    "stats": "lp_runner.decoding.metrics.GenerationStats",
    "adapter": "lp_runner.backends.adapter.ModelAdapter",
    "engine": "lp_runner.decoding.engine.LookaheadEngine",
    "policy": "lp_runner.tuning.policy.RoundPolicy",
    "pool": "lp_runner.decoding.pool.NGramPool",
}
RECORD_SECTIONS = {"run", "model", "policy", "stats"}  # a record's top-level sections (``jobs/worker.py``)


# ------------------------------------------------------------------------------------------ the package's names


def _module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__main__":  # runs the CLI on import
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@functools.cache
def _modules() -> dict[str, object]:
    return {name: importlib.import_module(name) for name in _module_names()}


@functools.cache
def _by_last_part() -> dict[str, list[object]]:
    """Module short name -> the package's modules of that name (``report``: jobs.report and studies.report)."""
    out: dict[str, list[object]] = {}
    for name, module in _modules().items():
        out.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    return out


@functools.cache
def _top_level() -> dict[str, list[object]]:
    """Every name defined at a package module's top level -> the objects of that name."""
    out: dict[str, list[object]] = {}
    for module in _modules().values():
        for key, value in vars(module).items():
            if getattr(value, "__module__", module.__name__) == module.__name__ or not callable(value):
                out.setdefault(key, []).append(value)
    return out


@functools.cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """What an instance of ``cls`` holds beyond its class attributes: dataclass fields, annotations and every
    ``self.NAME = ...`` in its (and its bases') source."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        names |= set(getattr(klass, "__annotations__", {}))
        if dataclasses.is_dataclass(klass):
            names |= {f.name for f in dataclasses.fields(klass)}
        try:
            tree = ast.parse(inspect.getsource(klass).strip())  # a nested class's source is indented
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            target = node.target if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else None
            targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        names.add(leaf.attr)
    return frozenset(names)


def _has(obj: object, attr: str) -> tuple[bool, object]:
    """Whether ``obj`` (a module, class or value) has ``attr``, and the attribute (None where only an instance
    holds it). A module's class or function counts only where it is defined or where a package re-exports it:
    ``engine.RoundLoop`` is stale though ``engine`` imports it."""
    if inspect.ismodule(obj):
        if hasattr(obj, attr):
            value = getattr(obj, attr)
            own = getattr(value, "__module__", None) in (None, obj.__name__)
            if (inspect.isclass(value) or inspect.isfunction(value)) and not own and not hasattr(obj, "__path__"):
                return False, None
            return True, value
        if hasattr(obj, "__path__"):  # a package: a submodule not imported yet
            try:
                return True, importlib.import_module(f"{obj.__name__}.{attr}")
            except ImportError:
                return False, None
        return False, None
    try:
        if hasattr(obj, attr):
            return True, getattr(obj, attr)
    except Exception:  # a descriptor that needs an instance
        return True, None
    cls = obj if isinstance(obj, type) else type(obj)
    return attr in _instance_attributes(cls), None


def _resolves_from(obj: object, rest: list[str]) -> bool:
    for attr in rest:
        found, value = _has(obj, attr)
        if not found:
            return False
        if value is None:
            return True  # an instance's attribute: what it holds is not known here
        obj = value
    return True


def _object(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def _written_keys() -> frozenset[str]:
    """Every string constant and keyword name of the package's source: the keys its records can hold."""
    keys = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                keys.add(node.value)
            elif isinstance(node, ast.keyword) and node.arg:
                keys.add(node.arg)
    return frozenset(keys)


def _resolves_in_package(parts: list[str]) -> bool:
    if parts[0] == "lp_runner":
        if len(parts) == 1:
            return True
        parts = parts[1:]
    modules = _modules()
    for cut in range(len(parts), 0, -1):  # a module path relative to lp_runner, longest first
        module = modules.get("lp_runner." + ".".join(parts[:cut]))
        if module is not None:
            return _resolves_from(module, parts[cut:])
    starts = _by_last_part().get(parts[0], []) + _top_level().get(parts[0], [])
    return any(_resolves_from(start, parts[1:]) for start in starts)


def _resolves_outside(parts: list[str]) -> bool | None:
    """An importable top-level module's attribute path: True / False, or None where ``parts[0]`` is no module."""
    if parts[0] in EXTERNAL:
        parts = EXTERNAL[parts[0]].split(".") + parts[1:]
    try:
        if importlib.util.find_spec(parts[0]) is None:
            return None
    except (ImportError, ValueError):
        return None
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return _resolves_from(module, parts[cut:])
    return None


def _config_key(parts: list[str]) -> bool:
    if len(parts) != 2:
        return False
    section, name = parts
    if section == config.ADVANCED:
        return name in config.ADVANCED_KEYS
    cls = config._SECTION_TYPES.get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


@functools.cache
def _repo_files() -> tuple[str, ...]:
    return tuple(str(p.relative_to(REPO)) for p in REPO.rglob("*.py") if ".venv" not in p.parts)


def resolves(name: str) -> bool:
    """Whether ``name`` (a dotted name or a ``.py`` path, as quoted) names something that exists."""
    if PATH.fullmatch(name):
        return any(f == name or f == f"lp_runner/{name}" or f.endswith("/" + name) for f in _repo_files())
    parts = name.split(".")
    if _config_key(parts) or _resolves_in_package(parts):
        return True
    if parts[0] in VARIABLES and _resolves_from(_object(VARIABLES[parts[0]]), parts[1:]):
        return True
    if parts[0] in RECORD_SECTIONS and set(parts[1:]) <= _written_keys():
        return True
    return bool(_resolves_outside(parts))


# ------------------------------------------------------------------------------------------ the quoted spans


def quoted_names(text: str, quote: str = "``") -> Iterator[tuple[int, str]]:
    """(line number, name) of every quoted span of ``text`` that reads as a name: a dotted name (with any call,
    index or value after it dropped) or a ``.py`` path; data files and ALL-CAPS placeholders are no names."""
    q = re.escape(quote)
    for m in re.finditer(rf"(?<!`){q}([^`\n]+?){q}(?!`)", text):
        span = m.group(1).strip()
        line = text.count("\n", 0, m.start()) + 1
        if PATH.fullmatch(span):
            yield line, span
            continue
        dotted = DOTTED.fullmatch(span)
        if not dotted:
            continue
        name = dotted.group(1)
        first, last = name.split(".")[0], name.rsplit(".", 1)[-1]
        if last in DATA_SUFFIXES or (first.isupper() and len(first) > 1):
            continue
        yield line, name


def _scopes(tree: ast.Module) -> list[tuple[int, int, frozenset[str]]]:
    """(first line, last line, names) of every function and class: its parameters, locals and attributes."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = set()
            if not isinstance(node, ast.ClassDef):
                a = node.args
                names |= {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x}
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
                elif isinstance(inner, ast.arg):
                    names.add(inner.arg)
                elif (
                    isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self"
                ):
                    names.add(inner.attr)
            out.append((node.lineno, node.end_lineno or node.lineno, frozenset(names)))
    return out


def unresolved_in_source(source: str, where: str = "<source>") -> list[str]:
    """``where:line: name`` for every quoted name of a Python source that names nothing."""
    scopes = _scopes(ast.parse(source))
    bad = []
    for line, name in quoted_names(source):
        first = name.split(".")[0]
        if any(lo <= line <= hi and first in names for lo, hi, names in scopes):
            continue  # an expression of the enclosing function's own names, not a package name
        if not resolves(name):
            bad.append(f"{where}:{line}: {name}")
    return bad


def unresolved_in_markdown(text: str, where: str) -> list[str]:
    return [f"{where}:{line}: {name}" for line, name in quoted_names(text, "`") if not resolves(name)]


# ------------------------------------------------------------------------------------------ the tests


def test_every_name_in_the_package_docstrings_exists() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        bad += unresolved_in_source(path.read_text(), str(path.relative_to(REPO)))
    assert not bad, "names that do not exist:\n" + "\n".join(bad)


def test_every_name_in_the_design_doc_exists() -> None:
    bad = unresolved_in_markdown(DESIGN.read_text(), str(DESIGN.relative_to(REPO)))
    assert not bad, "names that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("name", "exists"),
    [
        ("scheduler.RoundLoop", True),  # a module by its last part, then a class
        ("decoding.scheduler.RoundLoop.run", True),  # a module path relative to lp_runner
        ("lp_runner.parallel.exchange.agree_batch", True),
        ("exchange.Entry.max_emit", True),  # a dataclass field
        ("ModelAdapter.kv_shape", True),  # set in __init__
        ("lookahead.window_size", True),  # a config key
        ("advanced.max_verify_rows", True),
        ("parallel.groups.form_groups", True),  # a config key's name that is also a module
        ("torch.compile", True),
        ("exchange.py", True),
        ("engine.RoundLoop", False),  # moved to scheduler
        ("runner.start_worker", False),  # a module that is gone
        ("job_pool.read_pool_file", False),
        ("exchange.Exchange.agree", False),  # deleted
        ("lookahead.no_such_knob", False),
        ("advanced.window_size", False),  # a user key, not an advanced one
        ("torch.no_such_function", False),
        ("job_pool.py", False),
        ("stats.collectives", True),  # a conventional variable
        ("stats.no_such_count", False),
        ("run.device.load_peak_host_mib_ranks", True),  # a record key
        ("run.device.no_such_key", False),
        ("F.embedding", True),  # an outside name as its own docs write it
    ],
)
def test_a_name_resolves_only_where_it_exists(name: str, exists: bool) -> None:
    assert resolves(name) is exists


def test_a_stale_name_in_a_docstring_or_comment_is_reported() -> None:
    """A fake module: the stale names are reported by line, the names of the function's own arguments and the
    placeholders are not."""
    source = '''"""Runs through ``runner.run_prompts`` (gone) and ``scheduler.RoundLoop`` (there)."""


def f(feed):
    """``feed.post`` is the argument's; ``OUT.lock`` a placeholder; ``records.jsonl`` a file."""
    x = 1  # as ``engine.RoundLoop`` did, and ``job_pool.py``
    return x
'''
    assert unresolved_in_source(source, "fake.py") == [
        "fake.py:1: runner.run_prompts",
        "fake.py:6: engine.RoundLoop",
        "fake.py:6: job_pool.py",
    ]
    assert unresolved_in_markdown("see `runner.run_info` and `worker.run_jobs`\n", "fake.md") == [
        "fake.md:1: runner.run_info"
    ]


# ------------------------------------------------------------------------------------------ the module map


def module_map(text: str) -> list[str]:
    """The files ``docs/design.md``'s module map lists, as paths under ``lp_runner/``, in its order (a name twice
    is there twice). An entry's name is its first column (``name.py``, ``a.py, b.py``, ``folder/``), its depth the
    indentation (two spaces a level); lines indented past the names column continue the entry above."""
    block = text.split("## 10. Module map", 1)[1].split("```", 2)[1]
    folders: list[str] = []
    files = []
    for line in block.splitlines():
        m = re.match(r"( *)(\S.*?)(?:\s{2,}|$)", line)
        if not m or len(m.group(1)) >= 20 or m.group(2) == "lp_runner/":
            continue
        depth = len(m.group(1)) // 2 - 1
        del folders[depth:]
        for name in m.group(2).split(", "):
            if name.endswith("/"):
                folders.append(name.rstrip("/"))
            else:
                files.append("/".join([*folders, name]))
    return files


def _listed_modules() -> set[str]:
    """Every module of the package a map must list: each ``.py`` file, a package's ``__init__.py`` only where it
    holds more than its docstring."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            body = [n for n in ast.parse(path.read_text()).body if not isinstance(n, ast.Expr)]
            if all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in body):
                continue
        out.add(str(path.relative_to(PACKAGE)))
    return out


def test_the_module_map_lists_every_module_once_and_no_other() -> None:
    listed = [f for f in module_map(DESIGN.read_text()) if f.endswith(".py")]
    twice = sorted({f for f in listed if listed.count(f) > 1})
    assert not twice, f"listed twice: {twice}"
    assert sorted(_listed_modules() - set(listed)) == [], "modules the map does not list"
    assert sorted(set(listed) - _listed_modules()) == [], "the map lists modules that do not exist"


def test_the_module_map_parser_reads_names_folders_and_continuations() -> None:
    text = """## 10. Module map

```
lp_runner/
  api.py                     what it does,
                             over two lines
  a.py, b.py                 two at once
  decoding/                  a folder
    engine.py                inside it
    verify/
      greedy.py              two deep
  models/
    loading.py               back out
```
"""
    assert module_map(text) == [
        "api.py",
        "a.py",
        "b.py",
        "decoding/engine.py",
        "decoding/verify/greedy.py",
        "models/loading.py",
    ]
