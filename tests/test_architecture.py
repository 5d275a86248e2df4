"""The package structure the code claims (``docs/design.md``, section 10) holds in the code's own imports.

Read from the sources with ``ast`` (every import, at module level or inside a function): modules and packages
form a DAG, each package imports only the layers below it, and the CPU kernels are reached only through their
backend's plug-in.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from dist_helpers import REPO

PACKAGE = REPO / "lp_runner"
# Top to bottom: a package may import the ones after it, never one before it. Top-level modules sit where their
# job puts them: the entry points above everything, config / errors / logs / device / collector / outfiles at the
# bottom.
LAYERS = (
    ("__main__", "cli"),
    ("studies",),
    ("api",),
    ("jobs",),
    ("tuning",),
    ("decoding",),
    ("parallel", "backends"),
    ("models",),
    ("device", "config", "collector", "outfiles"),
    ("logs", "errors", "limits", "__init__"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every lp_runner module ``path`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lp_runner":  # from lp_runner import x: x may be a module or a name
                for alias in node.names:
                    candidate = f"lp_runner.{alias.name}"
                    found.add(candidate if _exists(candidate) else "lp_runner")
            elif node.module.startswith("lp_runner."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lp_runner.")}
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (REPO / rel).with_suffix(".py").is_file() or (REPO / rel / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        graph[name] = {m for m in _imports(path) if m != name and _exists(m)}
    return graph


def _unit(module: str) -> str:
    """The layer unit of a module: its first package under lp_runner, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_every_module_import_forms_a_dag() -> None:
    """No import circle, counting imports inside functions too (so none dodges a circle by being local)."""
    assert _cycle(_graph()) is None


def test_packages_import_only_the_layers_below_them() -> None:
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    units = {_unit(m) for m in _graph()}
    assert units <= set(rank), f"add {sorted(units - set(rank))} to LAYERS"
    upward = []
    for module, imported in _graph().items():
        for target in imported:
            a, b = _unit(module), _unit(target)
            if rank[b] < rank[a] and not (a == "__init__" and b == "api"):  # the lazy generate export
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_a_package_does_not_import_its_sibling_layer() -> None:
    """parallel and backends share a layer: neither needs the other."""
    graph = _graph()
    crossing = [
        f"{m} -> {t}" for m, ts in graph.items() for t in ts if {_unit(m), _unit(t)} == {"parallel", "backends"}
    ]
    assert crossing == []


def _top_level_imports(path: Path) -> set[str]:
    """The lp_runner modules ``path`` imports at module level (run when it is imported)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lp_runner."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lp_runner.")}
    return found


def test_only_the_backends_package_imports_the_cpu_plug_in_and_only_lazily() -> None:
    """Nothing outside ``lp_runner.backends.cpu`` imports it but ``lp_runner.backends`` (``select_backend``), and
    that import stands in a function: a GPU job, or ``model.backend: torch``, never runs it."""
    plug_in = "lp_runner.backends.cpu"
    importers = sorted(
        module
        for module, imported in _graph().items()
        if not (module + ".").startswith(plug_in + ".") and any((t + ".").startswith(plug_in + ".") for t in imported)
    )
    assert importers == ["lp_runner.backends"]
    eager = [
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        if not path.is_relative_to(PACKAGE / "backends" / "cpu")
        and any((t + ".").startswith(plug_in + ".") for t in _top_level_imports(path))
    ]
    assert eager == []


# The CPU plug-in's vocabulary: its kernels, their modules and their options, as its code names them. Outside
# lp_runner/backends/ none may appear (code, comments or docstrings): nothing above the backends knows which
# kernels run. Case-sensitive where a word is also ordinary English ("native" alone is not matched). Its weight
# arena (``arena.py``, ``Arena``) is its own; the K/V arena (``kv_cache.KVArena``) is every backend's.
KERNEL_WORDS = re.compile(
    r"(?i:prepack|onednn|mkldnn|huge.pages|arena\.py|weight arena|csrc|lp_native|native_gemm|native_layers|native\.py"
    r"|\bnative[- ](?:bf16|packed|kernels?|products?|layers?|attention|library|loop|code)\b|backends[./]cpu)"
    r"|\bNATIVE|\bArena\b|PackedLinear|SharedInputProduct|ProductSlice|build_id|[\"']native[\"']"
)
# The lines that must name them (by their start): the config's user-facing values of model.backend and the
# plug-in's advanced options, and the hint for the renamed key.
ALLOWED = {
    "lp_runner/config.py": (
        '"model.backend": ("auto", "torch", "native", "native-bf16"),',
        "huge_pages: bool = False  #",
        "native_layers: bool = True  #",
        '_RENAMED = {"model.prepack": "model.backend"}',
        "# the CPU plug-in's options (advanced.*; lp_runner/backends/cpu",
    ),
}


def test_no_kernel_name_outside_the_backends() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "backends"):
            continue
        rel = str(path.relative_to(REPO))
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if KERNEL_WORDS.search(line) and not line.strip().startswith(ALLOWED.get(rel, ())):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert found == []


def test_the_grep_finds_what_it_is_for() -> None:
    """The pattern matches each kernel name the plug-in uses, and not the ordinary word."""
    for hit in (
        "model.prepack",
        "oneDNN's product",
        "advanced.huge_pages",
        "native-bf16",
        "the native kernel",
        "NATIVE_GQA",
        "lp_native_llama_layers",
        "from lp_runner.backends.cpu import native",
        "'native'",
        "from lp_runner.backends.cpu.arena import Arena",
        "the packed-weight arena (arena.py)",
    ):
        assert KERNEL_WORDS.search(hit), hit
    for ordinary in ("a native int32 reduction runs at memory speed", "natively", "alternative", "the K/V arena",
                     "KVArena"):  # fmt: skip
        assert not KERNEL_WORDS.search(ordinary), ordinary


def test_the_config_takes_the_backends_registry_values() -> None:
    """``model.backend``'s choices in the config are the backends' registry (the config sits below the backends
    and cannot import it)."""
    from lp_runner import backends, config

    assert config._CHOICES["model.backend"] == backends.NAMES
    assert set(backends.PLUGIN_OPTIONS) <= set(config.ADVANCED_KEYS)


def _grep(pattern: str) -> list[str]:
    """``path:line`` of every line of the package matching ``pattern`` (comments included)."""
    regex = re.compile(pattern)
    return [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if regex.search(line)
    ]


def test_one_kv_layer_kind_one_arena_one_forward_one_round_loop() -> None:
    """The round path is one path: one kind of K/V cache layer (``kv_cache.ArenaLayer``, views of one arena),
    one K/V store (``kv_cache.KVArena``, the only maker of caches the rounds run on), the model's forward called
    through one ``model_call.ModelCall`` by the eager and the bucketed (compiled) rounds alike, and one round loop
    (``scheduler.RoundLoop``, made by the engine that every launcher's prompt loop runs)."""
    layer_classes = _grep(r"^class \w+\((?:\w+\.)?(?:DynamicLayer|DynamicSlidingWindowLayer|CacheLayerMixin|Cache)\)")
    assert [entry.split(":")[0] for entry in layer_classes] == ["lp_runner/backends/kv_cache.py"]
    assert len(_grep(r"^class \w+Arena\b")) == 1
    caches = {entry.split(":")[0] for entry in _grep(r"DynamicCache\(config")}
    # the arena's cache; the adapter's probes (which layers slide, what shape the layers cache) on throwaway ones
    assert caches == {"lp_runner/backends/kv_cache.py", "lp_runner/backends/adapter.py"}
    model_calls = {entry.split(":")[0] for entry in _grep(r"\bself\.model\(|\bmodel\(\s*input_ids")}
    # every round through ``model_call.ModelCall``; the adapter's one-token probe of the K/V shape beside it
    assert model_calls == {"lp_runner/backends/model_call.py", "lp_runner/backends/adapter.py"}
    assert len(_grep(r"\bself\.model\(")) == 2
    assert [entry.split(":")[0] for entry in _grep(r"\bRoundLoop\(")] == ["lp_runner/decoding/engine.py"]
    runs = {entry.split(":")[0] for entry in _grep(r"\badapter\.run\(")}
    assert "lp_runner/decoding/scheduler.py" in runs
    for removed in ("AppendBufferLayer", "StaticBufferLayer", "SlotCache", "OwnCacheForward", "BatchedForward",
                    "forward_batch", "compiled_forward"):  # fmt: skip
        assert _grep(rf"\b{removed}\b") == [], removed


def test_one_stager_one_mask_builder_one_round_function() -> None:
    """Every round, eager or compiled, on any backend: staged by one function (``staging.stage``), masked by one
    (``round_mask.round_mask``), run by one (``rounds.Rounds._round``), which the adapter's one entry
    (``ModelAdapter.run``) reaches through ``Rounds.forward``. The backend's whole layers plug in under it, chosen at
    construction: no ``forward_model`` returns None for the round to fall back on another path. What the merge made
    redundant is gone, not wrapped."""
    backends = PACKAGE / "backends"
    stagers = {f"{p.relative_to(REPO)}:{f}" for p in sorted(PACKAGE.rglob("*.py")) for f, _ in _calls(p, name="stage")}
    assert stagers == {"lp_runner/backends/rounds.py:forward"}
    builders = {
        f"{p.relative_to(REPO)}:{f}" for p in sorted(PACKAGE.rglob("*.py")) for f, _ in _calls(p, name="round_mask")
    }
    assert builders == {"lp_runner/backends/rounds.py:_round"}
    # an additive mask is made where a hidden value is written: the dtype's min, in the one builder only
    hidden = {entry.split(":")[0] for entry in _grep(r"finfo\(.*\)\.min") if "cpu/native.py" not in entry}
    assert hidden == {"lp_runner/backends/round_mask.py"}  # (native.py's is its self-test's random mask)
    model_calls = {f for p in sorted(PACKAGE.rglob("*.py")) for f, r in _calls(p, attribute="call") if r == "self"}
    assert model_calls == {"_round"}
    forwards = {f"{f}:{r}" for f, r in _calls(backends / "adapter.py", attribute="forward")}
    assert forwards == {"run:round_function"}  # ``self.rounds``, or on a compiled adapter its eager one
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "forward_model":
                returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)]
                assert all(r.value is not None and ast.unparse(r.value) != "None" for r in returns), path
    removed_names = ("pack_round", "BatchRound", "Segments", "SegmentedRound", "batched_attention", "packed_gqa_sdpa",
                     "native_gqa_attention", "StaticRounds", "segment_attention", "_eager")  # fmt: skip
    for removed in removed_names:
        assert _grep(rf"\b{removed}\b") == [], removed


def _calls(path: Path, attribute: str | None = None, name: str | None = None) -> list[tuple[str, str]]:
    """(enclosing function, receiver) of every call in ``path`` of the method ``attribute`` (``x.run(...)``:
    receiver ``x``'s source) or of the function ``name`` (receiver '')."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            func = node.func
            if attribute is not None and isinstance(func, ast.Attribute) and func.attr == attribute:
                found.append((function, ast.unparse(func.value)))
            if name is not None and isinstance(func, ast.Name) and func.id == name:
                found.append((function, ""))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


LENDERS_REMOVED = ("new_arena", "claim_arena", "release_arena", "job_region", "release_region", "region_size",
                   "new_cache", "forward")  # fmt: skip


def test_one_adapter_per_process_path_and_one_way_to_lend_kv() -> None:
    """A job builds one ``ModelAdapter``: ``start_worker`` makes it and ``choose_forward`` compiles that one
    (``ModelAdapter.compile``) instead of building a second beside it; the API (``_adapter_for``) and the acceptance
    recorder are entry points of their own, one adapter each. K/V is lent one way, the context manager
    ``ModelAdapter.arena`` (the job arena handed back on exit): no other public method of the adapter hands out an
    arena or a region, and the methods that did are gone."""
    from lp_runner.backends.adapter import ModelAdapter

    makers = sorted(
        f"{path.relative_to(REPO)}:{function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for function, _ in _calls(path, name="ModelAdapter")
    )
    assert makers == [
        "lp_runner/api.py:_adapter_for",
        "lp_runner/cli/acceptance.py:load_recorder",
        "lp_runner/jobs/worker.py:start_worker",
    ]
    public = {name: member for name, member in vars(ModelAdapter).items() if not name.startswith("_")}
    lenders = sorted(
        name
        for name, member in public.items()
        if callable(member) and re.search(r"\bKV(Arena|Region)\b", str(inspect.signature(member).return_annotation))
    )
    assert lenders == ["arena"]  # the scan finds the one there is: it returns Iterator[KVArena]
    assert hasattr(public["arena"], "__wrapped__")  # a context manager (contextlib's), so the arena comes back
    for removed in LENDERS_REMOVED:
        assert removed not in public, removed
        calls = [f"{path.relative_to(REPO)}:{f}" for path in sorted(PACKAGE.rglob("*.py")) for f, r in
                 _calls(path, attribute=removed) if "adapter" in r]  # fmt: skip
        assert calls == [], (removed, calls)


def test_run_jobs_is_the_only_caller_of_the_engines_job_entry() -> None:
    """Every launcher's prompts go through one job loop (``jobs.worker.run_jobs``): it alone calls
    ``LookaheadEngine.run`` (the engine's own ``generate``, one prompt, aside). A receiver that names an engine
    is what the scan looks for; the guard below shows it finds the one call there is."""
    callers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for function, receiver in _calls(path, attribute="run"):
            if "engine" in receiver.lower() or receiver == "self" and rel == "lp_runner/decoding/engine.py":
                callers.append(f"{rel}:{function}:{receiver}")
    assert callers == ["lp_runner/decoding/engine.py:generate:self", "lp_runner/jobs/worker.py:run_jobs:engine"]


def _classes_with(method: str) -> dict[str, str]:
    """Class name -> module path of every class of the package that defines ``method``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == method for item in node.body
            ):
                found[node.name] = str(path.relative_to(REPO))
    return found


def test_one_feeder_type_for_every_launcher() -> None:
    """One place says which prompt starts next: the ``Feeder`` protocol and its one implementation,
    ``PromptFeed``, which one process, torchrun groups and Ray actors all build (each with its own ``claim``);
    the queue order it hands out is made in one place (``JobPrompts.order``)."""
    assert _classes_with("next_index") == {
        "Feeder": "lp_runner/jobs/worker.py",
        "PromptFeed": "lp_runner/jobs/worker.py",
    }
    builders = {
        f"{path.relative_to(REPO)}:{function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for function, _ in _calls(path, name="PromptFeed")
    }
    assert builders == {
        "lp_runner/jobs/worker.py:run_prompts",
        "lp_runner/jobs/queue.py:run_queued",
        "lp_runner/jobs/ray.py:run",
    }
    orders = {
        f"{path.relative_to(REPO)}:{function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for function, _ in _calls(path, name="queue_order")
    }
    assert orders == {"lp_runner/jobs/prompts.py:order"}


def test_one_ray_elastic_loop_and_one_recovery_path() -> None:
    """D = 1 and D > 1 Ray jobs run one loop per lane (``_Driver._lane``): it alone catches a lost worker, and one
    helper (``_Driver._recover``) accounts for every loss."""
    ray_py = PACKAGE / "jobs" / "ray.py"
    tree = ast.parse(ray_py.read_text())
    catching = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ExceptHandler) and "_WorkerLost" in ast.unparse(inner.type or ast.Pass()):
                    catching.add(node.name)
    assert catching == {"_lane"}
    recover = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and "recover" in node.name]
    assert recover == ["_recover"]
    assert {function for function, _ in _calls(ray_py, attribute="_recover")} == {"_lane"}


def test_prompts_are_tokenized_in_one_place() -> None:
    """A job's prompts become token ids in one function (``prompts.prepare_prompts``, through ``encode``), once per
    process before the loop: no other module of the package calls ``encode`` or applies a chat template."""
    callers = {
        f"{path.relative_to(REPO)}:{function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for function, _ in _calls(path, name="encode")
    }
    assert callers == {"lp_runner/jobs/prompts.py:_checked_ids"}
    templates = {entry.split(":")[0] for entry in _grep(r"apply_chat_template\(")}
    assert templates == {"lp_runner/jobs/prompts.py"}
    # the job loop takes checked prompts and the API leaves the check to the engine's generate: none checks again
    checks = [entry for entry in _grep(r"\bcheck_prompts?\(") if not entry.startswith("lp_runner/decoding/")]
    assert checks == []
