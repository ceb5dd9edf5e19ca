"""Each module on its floor, checked on the source: a module imports only from floors below its own.

The package is built in floors, lowest first: the one refusal type every part raises (``refusals.py``), what
everything uses (the option checks, file writes, the decoder registry, the counters, the models), the kernels
(``ops/``), the options' dataclasses (``config.py``), what reads them (``options.py``, ``cluster/``, ``fastseq/``),
the adapters that attach to fairseq's objects, the step engines (``engine/``: every runner, fairseq's included) and
fairseq-generate's output (``cli/``), the decoders (``sequence_generators/``), the integration layer, the package's
entry, and the programs (``bench/``, ``serve/``, ``distill.py``). An import from a higher floor, at the top of a
module or inside a function, or between two units of one floor, would tie a lower part to a higher one: the check
names it. And a module's imports of the package sit at its top, none hidden inside a function, so that its
dependencies are read in one place.
"""

import ast
from pathlib import Path

import fairseq_fastgen

PACKAGE = Path(fairseq_fastgen.__file__).parent

FLOORS = [
    {"refusals"},
    {"safe_files", "checkpoint_safety", "stop_signals", "text_codec", "token_lists", "registry", "commands",
     "stock_fairseq", "models", "tasks"},
    {"option_checks", "counters", "ctranslate2_model"},
    {"criterions"},
    {"ops"},
    {"config"},
    {"options", "cluster", "fastseq"},
    {"adapters"},
    {"engine", "cli"},
    {"sequence_generators"},
    {"integration"},
    {"__init__"},
    {"bench", "serve", "distill"},
]
FLOOR_OF = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}


def unit_of(module: str) -> str:
    """The unit a dotted module name belongs to: ``fairseq_fastgen.engine.runners`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(tree: ast.AST, module: str):
    """(line, dotted name) of every import of the package's modules in ``tree``, inside functions too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            if base == "fairseq_fastgen" or (node.level and not node.module):  # from . import static_cache
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, name) for line, name in found if name == "fairseq_fastgen" or name.startswith("fairseq_fastgen.")]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports():
    """{module file: [(line, imported module)]} of every import that does not go to a lower floor."""
    offending = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = unit_of(module) if path != PACKAGE / "__init__.py" else "__init__"
        bad = []
        for line, name in imported_modules(ast.parse(path.read_text()), module):
            target = unit_of(name)
            if target != own and FLOOR_OF[target] >= FLOOR_OF[own]:
                bad.append((line, name))
        if bad:
            offending[str(path.relative_to(PACKAGE))] = bad
    return offending


def imports_inside_functions(tree: ast.AST, module: str):
    """(line, dotted name) of every import of the package's modules made inside a function of ``tree``."""
    found = []
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += imported_modules(ast.Module(body=function.body, type_ignores=[]), module)
    return sorted(set(found))


def hidden_imports():
    """{module file: [(line, imported module)]} of the package's imports made inside functions."""
    offending = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = imports_inside_functions(ast.parse(path.read_text()), module_name(path))
        if found:
            offending[str(path.relative_to(PACKAGE))] = found
    return offending


def test_every_unit_of_the_package_has_a_floor():
    units = {path.stem if path.is_file() else path.name
             for path in PACKAGE.iterdir() if (path.suffix == ".py" or (path / "__init__.py").exists())}
    assert units == set(FLOOR_OF)


def test_no_module_imports_from_its_floor_or_above():
    assert upward_imports() == {}


def test_no_module_imports_the_package_inside_a_function():
    """A module's dependencies on the package are read at its top: none hidden inside a function."""
    assert hidden_imports() == {}


def test_the_rule_sees_imports_inside_functions():
    source = ("from fairseq_fastgen.ops import heap\n"
              "def f():\n    import torch\n    from fairseq_fastgen.engine import aot_step\n"
              "class A:\n    def g(self):\n        from . import static_cache\n")
    names = [name for _, name in imports_inside_functions(ast.parse(source), "fairseq_fastgen.engine.runners")]
    assert names == ["fairseq_fastgen.engine", "fairseq_fastgen.engine.static_cache"]  # torch is not the package


def test_the_rule_sees_upward_imports():
    """What counts as an import of a unit, on a snippet of the engine's floor."""
    source = ("from fairseq_fastgen.sequence_generators.state import DecodingState\n"
              "def f():\n    from fairseq_fastgen import integration\n"
              "from fairseq_fastgen.ops import heap\n"
              "from . import static_cache\n"
              "import fairseq_fastgen.serve.app\n")
    names = [name for _, name in imported_modules(ast.parse(source), "fairseq_fastgen.engine.runners")]
    assert sorted(names) == ["fairseq_fastgen.engine.static_cache", "fairseq_fastgen.integration",
                             "fairseq_fastgen.ops", "fairseq_fastgen.sequence_generators.state",
                             "fairseq_fastgen.serve.app"]
    above = [name for name in names if FLOOR_OF[unit_of(name)] >= FLOOR_OF["engine"] and unit_of(name) != "engine"]
    assert sorted(above) == ["fairseq_fastgen.integration", "fairseq_fastgen.sequence_generators.state",
                             "fairseq_fastgen.serve.app"]
