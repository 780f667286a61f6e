"""The package edges of DESIGN.md, checked by reading the imports (no project code is run here, except
in the last test, which imports what a Ray Data read task imports and checks that torch stays out).

    jobs -> pipeline.train / pipeline.embed -> pipeline.data -> pipeline.storage / pipeline.compat / vit
    pipeline.dcp (checkpoint layout, shared by train and embed) and pipeline.cli (the jobs' dialect) sit low;
    pipeline.console (the jobs' console settings) lowest.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vit", "pipeline", "jobs")
MAX_LINES = 600
# The one module of vit/ allowed to import torch.distributed.
VIT_DISTRIBUTED_MODULE = "vit/parallelize.py"
# The one module allowed to touch private names of other libraries.
COMPAT_MODULE = "pipeline/compat.py"

# Room -> the rooms its modules may import from (besides third-party libraries). Arrows only go down.
ALLOWED = {
    "vit": {"vit"},
    # Settings: config dataclass fields with their doc line, flags and JSON (pipeline/settings.py).
    "pipeline.settings": {"pipeline.redaction"},
    # What outputs and printed lines may hold of how a job reached its data (pipeline/redaction.py).
    "pipeline.redaction": set(),
    # The linear probe: evaluate scores embeddings with it, fine-tuning starts a head from it.
    "pipeline.linear_probe": set(),
    # Storage, and the sections of a job's config that say how it reaches storage (Storage, Output).
    "pipeline.storage": {"pipeline.redaction", "pipeline.settings"},
    "pipeline.compat": set(),
    "pipeline.console": {"pipeline.compat"},
    "pipeline.cli": {"pipeline.console", "pipeline.settings", "pipeline.redaction"},
    "pipeline.dcp": {"pipeline.storage", "pipeline.compat", "vit"},
    # What --weights resolves to, for every job that takes a trained model (embed, evaluate, fine-tuning).
    "pipeline.model_source": {
        "pipeline.dcp",
        "pipeline.data",
        "pipeline.settings",
        "pipeline.storage",
        "pipeline.compat",
        "vit",
    },
    "pipeline.data": {
        "pipeline.data",
        "pipeline.redaction",  # a shard's name is its URL as outputs write it (pipeline.data.shards.shard_id)
        "pipeline.settings",
        "pipeline.cli",  # the make_shards job's exit codes (pipeline.data.make_shards.command)
        "pipeline.storage",
        "pipeline.compat",
        "vit",
    },
    "pipeline.train": {
        "pipeline.train",
        "pipeline.linear_probe",
        "pipeline.redaction",  # a checkpoint probe's error, as its row and log line hold it
        "pipeline.settings",
        "pipeline.cli",  # its job's parser, made from its config
        "pipeline.console",
        "pipeline.data",
        "pipeline.dcp",
        "pipeline.storage",
        "pipeline.compat",
        "vit",
        "pipeline.model_source",
    },
    "pipeline.embed": {
        "pipeline.embed",
        "pipeline.settings",
        "pipeline.cli",  # its job's parser, made from its config
        "pipeline.data",
        "pipeline.dcp",
        "pipeline.storage",
        "pipeline.compat",
        "vit",
        "pipeline.model_source",
    },
    # The export job: what --weights resolves to, as files timm or transformers load (vit.export).
    "pipeline.export": {
        "pipeline.cli",  # its job's parser, made from its config
        "pipeline.settings",
        "pipeline.storage",
        "pipeline.model_source",
        "vit",
    },
    # Reads what embed writes and loads weights as embed does; never pipeline.train.
    "pipeline.evaluate": {
        "pipeline.evaluate",
        "pipeline.linear_probe",
        "pipeline.settings",
        "pipeline.cli",  # its job's parser, made from its config
        "pipeline.embed",
        "pipeline.data",
        "pipeline.dcp",
        "pipeline.storage",
        "pipeline.compat",
        "vit",
        "pipeline.model_source",
    },
    # Indexes what embed writes (read with embed's reader) and embeds query images as embed does;
    # never pipeline.train, nor pipeline.evaluate.
    "pipeline.index": {
        "pipeline.index",
        "pipeline.settings",
        "pipeline.cli",  # its jobs' parsers, made from their configs
        "pipeline.embed",
        "pipeline.data",
        "pipeline.storage",
        "pipeline.compat",
        "vit",
        "pipeline.model_source",
    },
}


def imported_modules(path: Path) -> set[str]:
    """Every module name a file imports, at any depth (`import a.b`, `from a.b import c`), including
    imports inside functions and `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def python_files(*packages: str) -> list[Path]:
    files = sorted(f for package in packages for f in (ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {packages}"
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def importers(files: list[Path], module: str) -> list[str]:
    """Those of ``files`` that import ``module`` or a module inside it."""
    return [
        rel(f) for f in files if any(m == module or m.startswith(f"{module}.") for m in imported_modules(f))
    ]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str | None:
    """The room of a module of ours: ``pipeline.data.tar`` -> ``pipeline.data``; None for other code."""
    for name in sorted(ALLOWED, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


# Every module of ours, by name: the nodes of the import graph.
OURS = {module_name(f): f for f in python_files("vit", "pipeline")}


def project_imports(path: Path) -> set[str]:
    """The modules of ours that a file imports (`from pipeline import storage` -> `pipeline.storage`)."""
    out = set()
    for name in imported_modules(path):
        while name and name not in OURS:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def edge_violations(modules: dict[str, Path], allowed: dict[str, set[str]]) -> list[str]:
    """``"<module> imports <target>"`` for each import of ``modules`` (name -> file) against ``allowed``."""
    found = []
    for name, f in sorted(modules.items()):
        mine = room(name)
        if mine is None:
            continue
        for target in sorted(project_imports(f) - {"pipeline"}):
            theirs = room(target)
            if theirs is not None and theirs != mine and theirs not in allowed[mine]:
                found.append(f"{name} imports {target}")
    return found


def test_arrows_only_go_down():
    offenders = edge_violations(OURS, ALLOWED)
    assert not offenders, f"imports against the layering of DESIGN.md: {offenders}"


# --- the rooms of pipeline/train/ -------------------------------------------------------------------
# The loop, the driver and the session stay at the top of train/ and read its four rooms; a room reads
# the rooms below it and the modules of train/'s top that say what a run and a rank are (TRAIN_BASE),
# never the loop, the driver, the session or the other modules of the top that read the rooms.
TRAIN_BASE = {
    "pipeline.train.config",
    "pipeline.train.sections",
    "pipeline.train.state",
    "pipeline.train.resources",
}
TRAIN_ROOMS = {
    "pipeline.train.observe": set(),
    "pipeline.train.step": {"pipeline.train.observe"},  # MFU: the FLOPs an objective's step takes
    "pipeline.train.input": set(),
    "pipeline.train.checkpointing": {
        "pipeline.train.step",  # the EMA a checkpoint holds
        "pipeline.train.input",  # the cursor a checkpoint records
        "pipeline.train.observe",
    },
    # The checkpoint probe and the best checkpoint: the rows and log it writes into; the model's config
    # (the probe sets' patch size). Its scorer (embed + evaluate) is handed in by the jobs, never imported.
    "pipeline.train.scoring": {"pipeline.train.observe", "pipeline.train.step"},
}
# The room that runs under torchrun or in one plain process too (the train benchmark on a bare GPU
# machine): nothing it loads, through any module of ours, imports Ray.
NO_RAY_ROOM = "pipeline.train.step"


def train_room(module: str) -> str | None:
    """The room of train/ a module is in (``pipeline.train.input.cursor`` -> ``pipeline.train.input``)."""
    return next((r for r in TRAIN_ROOMS if module == r or module.startswith(r + ".")), None)


def train_room_violations(modules: dict[str, Path]) -> list[str]:
    """``"<module> imports <target>"`` for each import of train/ a room's module makes against
    `TRAIN_ROOMS` (its own room, the rooms it may read and `TRAIN_BASE` are allowed)."""
    found = []
    for name, f in sorted(modules.items()):
        mine = train_room(name)
        if mine is None:
            continue
        for target in sorted(project_imports(f)):
            if not target.startswith("pipeline.train.") or target in TRAIN_BASE:
                continue
            theirs = train_room(target)
            if theirs != mine and theirs not in TRAIN_ROOMS[mine]:
                found.append(f"{name} imports {target}")
    return found


def test_the_rooms_of_train_never_import_the_loop_and_read_only_down():
    offenders = train_room_violations(OURS)
    assert not offenders, f"imports against the rooms of pipeline/train/ (DESIGN.md): {offenders}"


def test_each_room_of_train_says_what_it_owns():
    for name in TRAIN_ROOMS:
        init = OURS[name]
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(text.split()) >= 20, f"{rel(init)}: its docstring says what the room owns"


def rooms_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """train/ as its top's modules and its rooms, each room one node (the picture of the folder)."""
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        if not name.startswith("pipeline.train."):
            continue
        node = train_room(name) or name
        targets = {train_room(t) or t for t in project_imports(f) if t.startswith("pipeline.train.")}
        graph.setdefault(node, set()).update(targets - {node})
    return graph


def test_no_arrow_of_train_runs_back_up():
    cycles = import_cycles(rooms_graph(OURS))
    assert not cycles, f"rooms of pipeline/train/ that import each other: {[' -> '.join(c) for c in cycles]}"


def imports_at_load(path: Path) -> set[str]:
    """The modules a file imports as it loads: its module body's imports, class bodies included, not those
    inside functions (they run when called) or under ``if TYPE_CHECKING:``."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def loads_ray(start: str, modules: dict[str, Path]) -> list[str]:
    """The modules that importing ``start``'s modules loads (through modules of ours, at any depth) and
    that import Ray as they load; ``start``'s own modules count with an import at any depth."""
    own = [m for m in modules if m == start or m.startswith(start + ".")]
    found, seen, todo = set(), set(), list(own)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        loaded = imported_modules(modules[name]) if name in own else imports_at_load(modules[name])
        if any(m == "ray" or m.startswith("ray.") for m in loaded):
            found.add(name)
        for target in loaded:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != "pipeline":
                todo.append(target)
    return sorted(found)


def test_the_step_room_loads_no_ray():
    offenders = loads_ray(NO_RAY_ROOM, OURS)
    assert not offenders, (
        f"{NO_RAY_ROOM} must run without Ray, but loads these, which import ray: {offenders}"
    )


def test_the_rooms_check_catches_a_room_importing_the_loop_and_a_room_above(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from pipeline.train.loop import Trainer\n")
    assert train_room_violations({"pipeline.train.observe.probe": probe}) == [
        "pipeline.train.observe.probe imports pipeline.train.loop"
    ]
    probe.write_text("from pipeline.train.checkpointing import saver\nfrom pipeline.train import state\n")
    assert "pipeline.train.step.probe imports pipeline.train.checkpointing.saver" in train_room_violations(
        {"pipeline.train.step.probe": probe}
    )
    probe.write_text("import ray\n")
    assert loads_ray(NO_RAY_ROOM, {**OURS, "pipeline.train.step.probe": probe}) == [
        "pipeline.train.step.probe"
    ]
    probe.write_text("from pipeline.train.input import feeder\n")  # which imports ray as it loads
    assert loads_ray(NO_RAY_ROOM, {**OURS, "pipeline.train.step.probe": probe}) == [
        "pipeline.train.input.feeder"
    ]
    (tmp_path / "up.py").write_text("from pipeline.train.step import model\n")
    graph = rooms_graph({**OURS, "pipeline.train.observe.probe": tmp_path / "up.py"})
    assert import_cycles(graph), "observe -> step -> observe is a circle of rooms"


def test_train_and_embed_never_import_each_other_and_data_imports_neither():
    # Stated on its own, so that loosening ALLOWED above cannot quietly drop it.
    offenders = [
        f"{rel(f)} -> {target}"
        for f in python_files("pipeline")
        for target in project_imports(f)
        if (room(module_name(f)), room(target))
        in {
            ("pipeline.train", "pipeline.embed"),
            ("pipeline.embed", "pipeline.train"),
            ("pipeline.data", "pipeline.train"),
            ("pipeline.data", "pipeline.embed"),
        }
    ]
    assert not offenders, offenders


def test_the_data_room_imports_no_torch():
    offenders = importers(python_files("pipeline/data"), "torch")
    assert not offenders, f"pipeline/data/ must not import torch (every decode worker loads it): {offenders}"


def test_vit_never_imports_ray():
    offenders = importers(python_files("vit"), "ray")
    assert not offenders, f"vit/ must stay pure PyTorch, but these import ray: {offenders}"


def test_only_one_vit_module_imports_torch_distributed():
    users = importers(python_files("vit"), "torch.distributed")
    assert set(users) <= {VIT_DISTRIBUTED_MODULE}, (
        f"only {VIT_DISTRIBUTED_MODULE} may import torch.distributed, found: {users}"
    )


def private_uses(path: Path) -> list[str]:
    """Private names of other code a file touches: ``obj._name`` on anything but self/cls, and
    imports of ``_private`` modules or names from outside the project."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PACKAGES:
                continue
            private = [p for p in node.module.split(".") if p.startswith("_") and not p.startswith("__")]
            private += [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private:
                found.append(f"from {node.module} import ... (line {node.lineno})")
    return found


def test_only_compat_touches_private_names_of_other_libraries():
    offenders = {
        rel(f): uses
        for f in python_files("pipeline", "jobs")
        if rel(f) != COMPAT_MODULE and (uses := private_uses(f))
    }
    assert not offenders, f"private APIs belong in {COMPAT_MODULE}: {offenders}"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (each reported once, from its first node met)."""
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycles_type_checking_imports_included():
    # A package's __init__ re-exporting its modules is not a cycle of design: edges into a package's
    # own __init__ from inside the package are left out (`import vit` inside vit/ names the package).
    graph = {}
    for name, path in OURS.items():
        graph[name] = {t for t in project_imports(path) if t != name and not name.startswith(t + ".")}
    cycles = import_cycles(graph)
    assert not cycles, f"import cycles: {[' -> '.join(c) for c in cycles]}"


def test_no_source_file_over_the_size_of_one_concept():
    long = {rel(f): n for f in python_files(*PACKAGES) if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by the nouns they hold): {long}"


def test_pipeline_defines_no_models():
    offenders = []
    for f in python_files("pipeline"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if bases & {"nn.Module", "torch.nn.Module", "Module"}:
                    offenders.append(f"{rel(f)}:{node.name}")
    assert not offenders, f"model definitions belong in vit/, found in pipeline/: {offenders}"


def test_tests_do_not_import_jobs():
    # jobs/ holds thin entry points; logic a test needs lives in vit/ or pipeline/.
    offenders = importers(sorted((ROOT / "tests").rglob("*.py")), "jobs")
    assert not offenders, f"tests import from jobs/ (move that logic to pipeline/ or vit/): {offenders}"


# Scripts of jobs/ that are no job of the shared command line: the demo runs the other jobs as a user
# would, the benchmark picks one of jobs/benchmarks/, docs writes docs/.
NOT_JOBS = {"demo.py", "benchmark.py", "docs.py"}


def job_main_calls(path: Path) -> list[str]:
    """What the ``main`` of a job script does, statement by statement (``return cli.main(...)`` alone in
    a job of the one shape)."""
    tree = ast.parse(path.read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return [ast.unparse(node).split("(", 1)[0] for node in main.body]


def test_each_job_is_one_call_to_cli_main():
    # Exit codes, the one-line error, Ctrl-C and Ray's failures are cli.main's; what a job does is a
    # library function a test can import. A job's main that does more is a copy of that, or logic.
    jobs = sorted(p for p in (ROOT / "jobs").glob("*.py") if p.name not in NOT_JOBS)
    assert len(jobs) >= 9
    offenders = {rel(p): job_main_calls(p) for p in jobs if job_main_calls(p) != ["return cli.main"]}
    assert not offenders, f"job scripts whose main is more than `return cli.main(...)`: {offenders}"


# --- the checks above are only as good as their readers: each must see what it looks for ----------


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import ray\n", {"ray"}),
        ("from ray.data import Dataset\n", {"ray.data", "ray.data.Dataset"}),
        ("def f():\n    import torch.distributed as dist\n", {"torch.distributed"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", {"torch"}),
    ],
)
def test_import_reader_sees_imports(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert expected <= imported_modules(path)


def test_layering_check_catches_an_upward_and_a_sideways_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from pipeline.train.config import TrainConfig\n")
    assert edge_violations({"pipeline.data.probe": probe}, ALLOWED) == [
        "pipeline.data.probe imports pipeline.train.config"
    ]
    probe.write_text("def f():\n    from pipeline.train.checkpointing import checkpoint\n")
    assert "pipeline.embed.probe imports pipeline.train.checkpointing.checkpoint" in edge_violations(
        {"pipeline.embed.probe": probe}, ALLOWED
    )
    probe.write_text("from pipeline import storage\nfrom pipeline.data.config import DataConfig\n")
    assert edge_violations({"pipeline.train.probe": probe}, ALLOWED) == []


def test_private_name_reader_sees_attributes_and_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader\n"
        "def f(fs, self):\n    return fs._strip_protocol('x'), self._mine, fs.__class__\n"
    )
    uses = private_uses(path)
    assert len(uses) == 2 and "fs._strip_protocol" in uses[1]


def test_cycle_finder_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# --- what a Ray Data read task imports --------------------------------------------------------------


def test_a_read_task_loads_no_torch(synthetic_shards):
    # Every Ray Data read task imports these modules and runs these functions; torch would cost each
    # decode worker a second and 300 MB. The source module needs Ray: it is imported with it.
    code = f"""
import sys
import pipeline.data.source, pipeline.data.dataset, pipeline.data.config, pipeline.data.bad_samples
from pipeline.data.config import DataConfig
from pipeline.data.decode import preprocess_batch
from pipeline.data.rows import read_shard
config = DataConfig(image_size=32, patch_size=8)
for block in read_shard({synthetic_shards.urls[0]!r}, config.row_spec, 8):
    rows = preprocess_batch(block.to_pydict() | {{}}, config=config, train=True, epoch=0)
print(rows["patches"].shape, "torch" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.split() == ["(4,", "16,", "192)", "False"], result.stdout
    # ... while the vit package still offers its whole API.
    code = "import vit; m = vit.create_model('vit_tiny_test'); print(m.config.embed_dim, 'torch' in __import__('sys').modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.split() == ["64", "True"]
