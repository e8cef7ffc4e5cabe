"""Where Ray may be imported, and which way the package's layers depend, read from every module's
syntax tree (nothing is imported or run).

- The layers (`LAYERS`, bottom first): a module imports only modules of its own layer and below,
  and no modules import each other in a circle.

- Ray (`ray`, `ray.*`) only under `raytrain_ft/launch/`: the loop, the checkpoints, the data rules,
  the run folder and the telemetry run without Ray (`torchrun`, `raytrain-ft check`, the benchmarks).
- Ray's private names (`ray.*._internal`, an underscored name imported from Ray, or an underscored
  attribute reached from `ray`, such as `ray._private`) only in `raytrain_ft/launch/ray_internals.py`,
  the one adapter that says why each is needed.
- torch's private DCP names (an underscored module or name of `torch.distributed.checkpoint`) only in
  `raytrain_ft/checkpoint/dcp_internals.py`, its adapter, with the torch versions it was checked against.
- No torch in what Ray Data's read tasks unpickle (`raytrain_ft.launch.datasource` and the
  modules it imports): each read task's worker process would import it for nothing. The same for
  the driver's own actors (`ProgressWatchdog`, `RecorderActor`): one process each per run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = Path(REPO, "raytrain_ft")
ADAPTER = PACKAGE / "launch" / "ray_internals.py"
DCP_ADAPTER = PACKAGE / "checkpoint" / "dcp_internals.py"


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute `import ...` / `from ... import` in `path`,
    at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def ray_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """`imports(path)` of `ray` and `ray.*`."""
    return [(line, module, names) for line, module, names in imports(path) if module.split(".")[0] == "ray"]


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_ray_is_imported_only_under_launch():
    outside = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in modules()
        if "launch" not in path.relative_to(PACKAGE).parts
        for line, module, _ in ray_imports(path)
    ]
    assert not outside, "Ray outside raytrain_ft/launch/: " + "; ".join(outside)


def private_attributes(path: Path, root: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every attribute chain from the name `root` with an underscored part
    (`ray._private.state`), read from the syntax tree."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        parts, inner = [], node
        while isinstance(inner, ast.Attribute):
            parts.insert(0, inner.attr)
            inner = inner.value
        if parts and isinstance(inner, ast.Name) and inner.id == root and any(p.startswith("_") for p in parts):
            found.append((node.lineno, ".".join([root, *parts])))
    return found


def test_rays_private_names_are_imported_only_by_the_adapter():
    private = [
        f"{path.relative_to(REPO)}:{line} imports {module} {names}"
        for path in modules()
        if path != ADAPTER
        for line, module, names in ray_imports(path)
        if "_internal" in module.split(".") or any(n.startswith("_") for n in names)
    ]
    private += [
        f"{path.relative_to(REPO)}:{line} reads {name}"
        for path in modules()
        if path != ADAPTER
        for line, name in private_attributes(path, "ray")
    ]
    assert not private, "Ray's private names outside launch/ray_internals.py: " + "; ".join(private)
    assert any("_internal" in module for _, module, _ in ray_imports(ADAPTER))
    assert any(name.startswith("ray._private") for _, name in private_attributes(ADAPTER, "ray"))


def test_torchs_private_dcp_names_are_imported_only_by_their_adapter():
    private = [
        f"{path.relative_to(REPO)}:{line} imports {module} {names}"
        for path in modules()
        if path != DCP_ADAPTER
        for line, module, names in imports(path)
        if module.startswith("torch.distributed.checkpoint")
        and (any(p.startswith("_") for p in module.split(".")) or any(n.startswith("_") for n in names))
    ]
    assert not private, "torch's private DCP names outside checkpoint/dcp_internals.py: " + "; ".join(private)
    assert any("._fsspec_filesystem" in module for _, module, _ in imports(DCP_ADAPTER))


def test_the_checks_see_function_level_imports_and_attributes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f():\n    import ray.data\n    from ray.train.v2._internal.x import Y\n    ray._private.x()\n"
    )
    assert private_attributes(sample, "ray") == [(4, "ray._private.x"), (4, "ray._private")]
    assert [(line, module) for line, module, _ in ray_imports(sample)] == [
        (2, "ray.data"),
        (3, "ray.train.v2._internal.x"),
    ]


def closure(module: str) -> set[str]:
    """`module` and every module it imports, following the package's own modules transitively."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = Path(REPO, *name.split(".")).with_suffix(".py")
        if name.startswith("raytrain_ft.") and path.exists():
            todo += sorted({module for _, module, _ in imports(path)})
    return seen


def torch_in(module: str) -> list[str]:
    """What brings torch into `module`'s process: torch, transformers or torchft themselves, or Ray
    Train's torch backends (`ray.train.torch*`, which import torch), directly or through
    `launch.ray_internals`, which imports them."""
    loaded = closure(module)
    return sorted(
        m
        for m in loaded
        if m.split(".")[0] in ("torch", "transformers", "torchft")
        or m.startswith("ray.train.torch")
        or m == "raytrain_ft.launch.ray_internals"
    )


def test_ray_datas_read_tasks_import_no_torch():
    assert "raytrain_ft.data.order" in closure("raytrain_ft.launch.datasource")  # what a read task's EpochOrder needs
    assert torch_in("raytrain_ft.launch.datasource") == []


def test_the_drivers_actors_import_no_torch():
    for actor_module in ("raytrain_ft.launch.progress_watchdog", "raytrain_ft.launch.recorder_actor"):
        assert torch_in(actor_module) == [], actor_module
    assert "raytrain_ft.launch.ray_internals" in torch_in("raytrain_ft.launch.callbacks")  # the check sees it


# The sub-packages, bottom first: each may import only its own modules and those of the packages
# before it (docs/architecture.md shows the same order). The package root holds `cli` alone.
LAYERS = ("core", "data", "checkpoint", "model", "resilience", "telemetry", "training", "launch", "cli")


def layer(module: str) -> str | None:
    """The layer of a `raytrain_ft` module name (`raytrain_ft.core.errors` -> `core`); None outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "raytrain_ft" and len(parts) > 1 else None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def package_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a `raytrain_ft` module in `path`, at any depth (TYPE_CHECKING
    and function-level imports too: they are dependencies all the same); `from raytrain_ft.x import y`
    counts as `raytrain_ft.x.y` when that is a module."""
    found = []
    for line, module, names in imports(path):
        if layer(module) is None and module != "raytrain_ft":
            continue
        found.append((line, module))
        for name in names:
            sub = Path(PACKAGE.parent, *f"{module}.{name}".split("."))
            if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                found.append((line, f"{module}.{name}"))
    return found


def test_the_package_root_holds_the_layers_and_the_cli_only():
    root = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert root == set(LAYERS), sorted(root ^ set(LAYERS))


def test_no_import_runs_up_the_layers():
    upward = []
    for path in modules():
        own = layer(module_name(path))
        for line, module in package_imports(path):
            target = layer(module)
            if own in LAYERS and target in LAYERS and LAYERS.index(target) > LAYERS.index(own):
                upward.append(f"{path.relative_to(REPO)}:{line} ({own}) imports {module} ({target})")
    assert not upward, "imports up the layers (" + " < ".join(LAYERS) + "): " + "; ".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph = {module_name(p): {m for _, m in package_imports(p)} for p in modules()}
    graph = {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}
    circles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state[t] == 1:
                circles.append(" -> ".join([*path[path.index(t) :], t]))
            elif state[t] == 0:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(circles)


MAX_LINES = 400  # one job per module: a module past this does several (split it before growing it)


def test_no_module_is_over_the_line_bound():
    long = {str(p.relative_to(REPO)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
