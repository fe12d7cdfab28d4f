"""The shape the project promises: the method in a handful of top-level files, the support
package beneath them, the commands above. Imports run one way, scripts -> method ->
support, and never in a circle, counting the imports inside functions too (a lazy
import is how a circle hides)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = ["train", "agentflow", "engine", "memory", "tools", "judge", "flow_grpo", "lora", "eval"]  # the reading path


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> file for the top-level files, support/ and scripts/ (not tests/)."""
    files = list(root.glob("*.py")) + list(root.glob("support/**/*.py")) + list(root.glob("scripts/**/*.py"))
    mods = {}
    for f in files:
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def imports(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file."""
    mods = project_modules(root)
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # "from support import speed" imports the module support.speed
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def layer(module: str) -> int:
    """0 support, 1 the method (the top-level files), 2 the commands."""
    top = module.split(".")[0]
    return {"support": 0, "scripts": 2}.get(top, 1)


def problems(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs upward, and every circle (as one path through it)."""
    out = [f"{a} imports {b}: an upward import" for a in sorted(graph) for b in sorted(graph[a])
           if layer(b) > layer(a)]
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                out.append("circle: " + " -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return out


def test_imports_run_one_way_without_a_circle():
    graph = imports(ROOT)
    assert set(METHOD) <= set(graph), "a reading-path file is missing from the top level"
    assert any(m.startswith("support.") for m in graph) and any(m.startswith("scripts.") for m in graph)
    assert not problems(graph), "\n".join(problems(graph))


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    """The checker on a house built to break both rules, the breaking imports inside
    functions: it must name each."""
    (tmp_path / "support").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "support" / "__init__.py").write_text("")
    (tmp_path / "support" / "a.py").write_text("def f():\n    from support import b\n")
    (tmp_path / "support" / "b.py").write_text("import support.a\n\ndef g():\n    import train\n")
    (tmp_path / "train.py").write_text("from support.a import f\n\ndef h():\n    from scripts.run import main\n")
    (tmp_path / "scripts" / "run.py").write_text("import train\n")
    found = problems(imports(tmp_path))
    assert "support.b imports train: an upward import" in found
    assert "train imports scripts.run: an upward import" in found
    assert any(p.startswith("circle: ") and "support.a" in p and "support.b" in p for p in found), found


def test_the_readmes_reading_path_names_the_method_files():
    """The README's reading-path table names each method file, in reading order. (Its line
    counts are information for a reader, not a claim a fork's edit should break CI over.)"""
    import re
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)\.py` \|", readme, flags=re.M)
    assert rows[:len(METHOD)] == METHOD
