"""The house's rules, read from the code's own imports: no torch below the inference service, no arrow up a floor."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_PACKAGES = ("cache_daemon", "kvboost_common", "kvboost_keys", "http_gateway")
# The router reads the replicas' tokenizer from its files (tokenizers, jinja2); its tokenizer module falls back to
# transformers' tokenizers backend, imported only for a source it cannot read alone. It never names torch, no other
# router module names transformers, and importing the router loads neither.
ROUTER_TOKENIZER_MODULE = "router/tokenizer.py"
ROUTER_TRANSFORMERS_IMPORTS = {"transformers.tokenization_utils_tokenizers",
                               "transformers.tokenization_utils_tokenizers.PreTrainedTokenizerFast"}
# Rooms of inference_service, by floor: a module imports from its own room or from a lower floor only.
# serving (gRPC) -> engine (the step loop) -> engine_parts (what every request is run with: the engine's parts, one
# request's plan, sampling, outcome, counters) -> reuse (K/V from and to the store) -> kv (K/V maths, blobs,
# repair) | config -> model -> kv_memory (K/V slots and buffers, the memory plan, L0 and the host tier) -> store
# -> errors.
ROOM_FLOORS = {"__main__": 9, "serving": 8, "engine": 7, "engine_parts": 6, "reuse": 5, "kv": 4, "config": 4,
               "model": 3, "kv_memory": 2, "store": 1,
               "errors": 0, "mkl_dispatch": 0}
# Which top-level packages each product package may import (besides the stdlib and third parties).
ALLOWED_PACKAGES = {
    "kvboost_common": {"kvboost_common"},
    "cache_daemon": {"cache_daemon", "kvboost_common", "kvboost"},
    "kvboost_keys": {"kvboost_keys"},
    "inference_service": {"inference_service", "kvboost_common", "kvboost_keys", "kvboost"},
    "router": {"router", "kvboost_common", "kvboost_keys", "kvboost"},
    "client": {"client", "kvboost_common", "kvboost"},
    "http_gateway": {"http_gateway", "kvboost_common", "kvboost"},
    # The composition root: the gateway's app and the inference service in one process; nothing imports it.
    "kvboost_server": {"kvboost_server", "http_gateway", "inference_service", "kvboost_common", "kvboost"},
}
FIRST_PARTY = {"cache_daemon", "inference_service", "client", "kvboost_common", "kvboost_keys", "kvboost", "http_gateway",
               "router", "kvboost_server", "bench", "tests"}


def imported_modules(path: Path, root: Path = ROOT) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package under root)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def room_of(module: str) -> str:
    """'engine' for inference_service.engine.batch; 'errors' for inference_service.errors."""
    return module.split(".")[1]


@pytest.mark.parametrize("package", TORCH_FREE_PACKAGES)
def test_torch_free_packages_never_name_torch(package):
    for path in sources(package):
        heavy = [name for name in imported_modules(path) if name.split(".")[0] in ("torch", "transformers")]
        assert not heavy, f"{path.relative_to(ROOT)} imports {heavy}; {package} must stay torch-free"


def loaded_heavy_modules(packages: tuple[str, ...], heavy: tuple[str, ...]) -> str:
    """The modules of `heavy` top-level packages loaded, in a clean interpreter, by importing every module of
    `packages` (every transitive import counts)."""
    probe = ("import importlib, pkgutil, sys\n"
             f"for top in {packages!r}:\n"
             "    package = importlib.import_module(top)\n"
             "    for info in pkgutil.walk_packages(package.__path__, top + '.'):\n"
             "        importlib.import_module(info.name)\n"
             f"print(sorted(name for name in sys.modules if name.split('.')[0] in {heavy!r}))\n")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return loaded.stdout.strip()


def test_torch_free_packages_load_no_torch_when_imported():
    assert loaded_heavy_modules(TORCH_FREE_PACKAGES, ("torch", "transformers")) == "[]"


def test_the_router_never_names_torch_and_names_transformers_in_one_module():
    for path in sources("router"):
        names = imported_modules(path)
        assert not [name for name in names if name.split(".")[0] == "torch"], f"{path.relative_to(ROOT)} imports torch"
        transformers = {name for name in names if name.split(".")[0] == "transformers"}
        allowed = ROUTER_TRANSFORMERS_IMPORTS if str(path.relative_to(ROOT)) == ROUTER_TOKENIZER_MODULE else set()
        assert transformers <= allowed, f"{path.relative_to(ROOT)} imports {sorted(transformers - allowed)}"


def test_the_router_loads_neither_torch_nor_transformers_when_imported():
    # transformers alone costs the router's start-up most of a second; its tokenizer fallback imports it on use.
    assert loaded_heavy_modules(("router",), ("torch", "transformers")) == "[]"


def test_every_inference_service_module_sits_in_a_known_room():
    for path in sources("inference_service"):
        parts = path.relative_to(ROOT / "inference_service").with_suffix("").parts
        assert parts[0] in ROOM_FLOORS or parts == ("__init__",), f"{path.relative_to(ROOT)} is in no room of {sorted(ROOM_FLOORS)}"


def upward_imports(package_dir: Path) -> list[str]:
    """'file (room) -> module' for every import of a room above or beside the file's own."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts == ("__init__",):
            continue
        own = parts[0]
        for name in imported_modules(path, package_dir.parent):
            if name.startswith("inference_service.") and room_of(name) != own \
                    and ROOM_FLOORS[room_of(name)] >= ROOM_FLOORS[own]:
                found.append(f"{path.relative_to(package_dir.parent)} ({own}) -> {name}")
    return sorted(set(found))


def test_no_inference_service_module_imports_a_room_above_or_beside_its_own():
    upward = upward_imports(ROOT / "inference_service")
    assert not upward, "imports that run up or across a floor:\n" + "\n".join(upward)


def test_the_rule_catches_upward_and_sideways_imports(tmp_path):
    # The walker itself, on a small tree: kv importing the engine and model importing kv are reported.
    package = tmp_path / "inference_service"
    for room in ("kv", "model", "engine"):
        (package / room).mkdir(parents=True)
    (package / "kv" / "probe.py").write_text("from inference_service.engine.pipeline import generate_one\n")
    (package / "model" / "probe.py").write_text("from ..kv import rope\n")
    (package / "engine" / "fine.py").write_text("from inference_service.kv import blobs\nimport torch\n")
    assert upward_imports(package) == [
        "inference_service/kv/probe.py (kv) -> inference_service.engine.pipeline",
        "inference_service/kv/probe.py (kv) -> inference_service.engine.pipeline.generate_one",
        "inference_service/model/probe.py (model) -> inference_service.kv",
        "inference_service/model/probe.py (model) -> inference_service.kv.rope",
    ]


@pytest.mark.parametrize("package", sorted(ALLOWED_PACKAGES))
def test_packages_import_only_what_they_may(package):
    wrong = []
    for path in sources(package):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top in FIRST_PARTY and top not in ALLOWED_PACKAGES[package]:
                wrong.append(f"{path.relative_to(ROOT)} -> {name}")
    assert not wrong, f"{package} may import {sorted(ALLOWED_PACKAGES[package])} only:\n" + "\n".join(wrong)


ENGINE_ROOM = ROOT / "inference_service" / "engine"
MAX_ENGINE_CHAIN = 4  # modules in the longest chain of run-time imports inside inference_service/engine/
MAX_MODULE_LINES = 300


def runtime_engine_imports(path: Path) -> set[str]:
    """The engine modules a file imports when it runs (imports under `if TYPE_CHECKING:` are for annotations)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(sub) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.module == "inference_service.engine":
            found |= {alias.name for alias in node.names}
        elif node.module.startswith("inference_service.engine."):
            found.add(node.module.split(".")[2])
    return found


def longest_chain(arrows: dict[str, set[str]]) -> tuple[str, ...]:
    memo: dict[str, tuple[str, ...]] = {}

    def chain(module: str, seen: tuple[str, ...] = ()) -> tuple[str, ...]:
        assert module not in seen, f"import cycle: {' -> '.join(seen + (module,))}"
        if module not in memo:
            below = [chain(name, seen + (module,)) for name in arrows[module]]
            memo[module] = (module,) + max(below, key=len, default=())
        return memo[module]

    return max((chain(module) for module in arrows), key=len)


def test_longest_chain_helper_follows_the_arrows():
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ("a", "b", "c")


def test_the_engine_room_is_shallow_and_its_modules_small():
    modules = {path.stem: path for path in ENGINE_ROOM.glob("*.py") if path.stem != "__init__"}
    arrows = {name: runtime_engine_imports(path) & set(modules) for name, path in modules.items()}
    chain = longest_chain(arrows)
    assert len(chain) <= MAX_ENGINE_CHAIN, f"engine import chain of {len(chain)}: {' -> '.join(chain)}"
    long = {name: n for name, path in modules.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"engine modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("module", ["engine/scheduler", "kv_memory/slot_ledger"])
def test_the_scheduler_decides_without_tensors(module):
    heavy = [name for name in imported_modules(ROOT / "inference_service" / f"{module}.py")
             if name.split(".")[0] in ("torch", "transformers") or ".model." in name or name.endswith(".model")]
    assert not heavy, f"{module}.py imports {heavy}: the scheduler and its ledger must stay pure"


def module_arrows(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every import counted wherever it sits (a function-local import
    runs too, later) except those under `if TYPE_CHECKING:`, which never run. A name resolves to the longest
    module it starts with (`pkg.mod.Name` -> `pkg.mod`; `pkg.sub` -> its `__init__`)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    arrows = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(sub) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}
        names = [name for name in imported_modules(path, root) if name.startswith(package_dir.name)]
        if typing_only:  # the same walk over the file without its TYPE_CHECKING blocks
            kept = ast.Module(body=[node for node in tree.body if id(node) not in typing_only], type_ignores=[])
            names = [name for node in ast.walk(kept) if isinstance(node, (ast.Import, ast.ImportFrom))
                     for name in _names_of(node, module, path)]
        targets = set()
        for name in names:
            parts = name.split(".")
            found = next((".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in modules),
                         None)
            if found is not None and found != module:
                targets.add(found)
        arrows[module] = targets
    return arrows


def _names_of(node: ast.stmt, module: str, path: Path) -> list[str]:
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or around a loop (Tarjan's strongly connected
    components of more than one module), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(arrows.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(arrows):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_import_cycle_anywhere_in_the_inference_service():
    cycles = import_cycles(module_arrows(ROOT / "inference_service"))
    assert not cycles, "modules that import each other (function-local imports count):\n" + "\n".join(
        " <-> ".join(group) for group in cycles)


def test_the_cycle_check_sees_function_local_imports_and_skips_type_checking_ones(tmp_path):
    package = tmp_path / "inference_service"
    (package / "model").mkdir(parents=True)
    (package / "model" / "__init__.py").write_text("")
    (package / "model" / "a.py").write_text("from inference_service.model.b import B\n")
    (package / "model" / "b.py").write_text("def probe():\n    from inference_service.model.a import A\n")
    (package / "model" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from inference_service.model.d import D\n")
    (package / "model" / "d.py").write_text("from . import c\n")
    arrows = module_arrows(package)
    assert arrows["inference_service.model.b"] == {"inference_service.model.a"}
    assert arrows["inference_service.model.c"] == set()
    assert arrows["inference_service.model.d"] == {"inference_service.model", "inference_service.model.c"}
    assert import_cycles(arrows) == [["inference_service.model.a", "inference_service.model.b"]]


def test_every_product_package_is_installed():
    """`pip install .` (the Dockerfile's images) installs the packages pyproject.toml lists: a new sub-package
    left out of the list would be missing from an installed copy."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    top = {name.split(".")[0] for name in listed}
    on_disk = {str(init.parent.relative_to(ROOT)).replace("/", ".") for package in top
               for init in (ROOT / package).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
