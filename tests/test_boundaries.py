"""The package edges of DESIGN.md, checked by reading the imports (no code is run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The one module of vit/ allowed to import torch.distributed.
VIT_DISTRIBUTED_MODULE = "vit/parallelize.py"


def imported_modules(path: Path) -> set[str]:
    """Every module name a file imports, at any depth (`import a.b`, `from a.b import c`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def python_files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_vit_never_imports_ray():
    offenders = [
        rel(f)
        for f in python_files("vit")
        if any(m == "ray" or m.startswith("ray.") for m in imported_modules(f))
    ]
    assert not offenders, f"vit/ must stay pure PyTorch, but these import ray: {offenders}"


def test_only_one_vit_module_imports_torch_distributed():
    users = [
        rel(f)
        for f in python_files("vit")
        if any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in imported_modules(f))
    ]
    assert set(users) <= {VIT_DISTRIBUTED_MODULE}, (
        f"only {VIT_DISTRIBUTED_MODULE} may import torch.distributed, found: {users}"
    )


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
    offenders = [
        rel(f)
        for f in sorted((ROOT / "tests").rglob("*.py"))
        if any(m == "jobs" or m.startswith("jobs.") for m in imported_modules(f))
    ]
    assert not offenders, f"tests import from jobs/ (move that logic to pipeline/ or vit/): {offenders}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import ray\n", {"ray"}),
        ("from ray.data import Dataset\n", {"ray.data", "ray.data.Dataset"}),
        ("def f():\n    import torch.distributed as dist\n", {"torch.distributed"}),
    ],
)
def test_import_reader_sees_imports(tmp_path, source, expected):
    # The checks above are only as good as the reader: it must see top-level and nested imports.
    path = tmp_path / "m.py"
    path.write_text(source)
    assert expected <= imported_modules(path)


def test_the_data_pipeline_imports_no_torch():
    # Every Ray Data decode worker imports these; torch would cost each worker a second and 300 MB.
    import subprocess
    import sys

    code = "import sys, vit, vit.patchify, vit.config, pipeline.data.decode; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.strip() == "False"
    # ... while the package still offers its whole API.
    code = "import vit; print(vit.create_model('vit_tiny_test').config.embed_dim, len(vit.__all__))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.split() == ["64", "16"]
