"""The package declares exactly the distributions its code imports (plus those it needs through another
library, named with the reason), and says what it is."""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THROUGH = {"accelerate"}  # transformers loads GGUF files through it (kvseal bench --hf-baseline)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_declared_dependencies_are_exactly_those_imported():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {norm(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    dists = packages_distributions()
    imported = set()
    for f in (ROOT / "kvseal").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for n in names:
                top = n.split(".")[0]
                if top in sys.stdlib_module_names or top == "kvseal":
                    continue
                imported |= {norm(d) for d in dists.get(top, [top])}
    assert declared - THROUGH == imported, (f"declared, never imported: {sorted(declared - THROUGH - imported)}; "
                                            f"imported, not declared: {sorted(imported - declared)}")


def test_the_package_says_what_it_is():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().count("Apache License") >= 1
    assert project["readme"] == "README.md" and project["classifiers"]
    assert (ROOT / "CHANGELOG.md").exists()
