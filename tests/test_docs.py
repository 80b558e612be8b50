"""The docs name only what exists: every repository path the README and docs/ mention is a file here (bench/out/
is what the benchmarks write), and every ``--flag`` they mention is one some kvseal command or script defines,
or one of the peers' flags the benchmarks pass on (named below)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# llama-server's and vLLM's (in the benchmark notes), Prometheus' (in the operator's tour)
PEERS = {"--cont-batching", "--parallel", "--enforce-eager", "--config", "--storage",  # other tools' flags
         "--no-deps", "--only-binary", "--platform", "--python-version"}  # pip's
PREFIXES = ("--unsafe-", "--unsafe-no-")  # the protections' switches, named as a family


def defined_flags() -> set[str]:
    flags = set()
    for f in [*ROOT.glob("kvseal/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("formal/*.py")]:
        for m in re.finditer(r"add_argument\(([^)]*)", f.read_text()):
            flags |= set(re.findall(r"\"(--[a-z0-9-]+)\"", m.group(1)))
    from kvseal.config import UNSAFE_FLAGS

    return flags | set(UNSAFE_FLAGS.values())


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for m in re.findall(r"\b((?:kvseal|tests|bench|docs|deploy|formal)/[\w./-]+\.(?:py|md|yaml|yml|json|cpp|h|html|tla|pml))",
                            doc.read_text()):
            if not m.startswith("bench/out/") and not (ROOT / m).exists():
                missing.append(f"{doc.name}: {m}")
    assert not missing, missing


def test_every_flag_the_docs_name_is_defined():
    known = defined_flags() | PEERS
    unknown = sorted({(doc.name, f) for doc in DOCS for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", doc.read_text())
                      if f not in known and f not in PREFIXES})
    assert not unknown, unknown


def test_the_readme_layout_names_every_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    layout = layout[: layout.index("\n## ", 5)]
    missing = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "kvseal").rglob("*.py"))
               if f.name != "__init__.py" and f.name not in layout]
    assert not missing, f"modules the README's layout does not name: {missing}"
