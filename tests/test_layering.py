"""The library's layering, checked from the source (docs/architecture.md §14).

Every module of `glm53/` and `kernels/` belongs to one layer; it may import only from its own layer or the
layers below, the import graph has no cycle, and project modules are imported at module level only (an import
inside a function is for an optional third-party dependency and carries a one-line reason as a comment).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("glm53", "kernels")

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("glm53", "glm53.errors", "glm53.dims", "glm53.files", "glm53.assets", "glm53.logs",
     "glm53.progress"),  # names, errors, files, the shipped model's path, quiet third-party logs, progress
    ("glm53.quant.registry", "glm53.quant.formats", "glm53.quant.tables", "glm53.quant.mixes"),  # format tables, mixes
    ("glm53.config",),  # frozen config dataclasses
    ("glm53.quant",),  # dequantizers, planes, re-encoding, byte counts, the quantized-experts leaf
    ("glm53.io",),  # raw readers: byte sources, GGUF, safetensors
    ("kernels",),  # one folder per op: api / reference / pallas
    ("glm53.config.kernels",),  # the kernels section: validated against the kernel packages' own tables
    ("glm53.layers",),  # Flax NNX layers
    ("glm53.model",),  # the model and its caches
    ("glm53.parallel",),  # sharding rules, sharded MoE, placement
    ("glm53.checkpoint",),  # HF / GGUF / Orbax loading, conversion and export
    ("glm53.memory",),  # per-device memory budget from the sharding rules
    ("glm53.tokenizer", "glm53.runtime", "glm53.scoring", "glm53.build"),  # running it: the runtime (device programs, decode weights, sampling)
    ("glm53.serving",),  # continuous-batching engine and the OpenAI / Anthropic HTTP APIs (FastAPI)
    ("glm53.data", "glm53.train"),  # training data (corpus, tokenizer, packing) and the training loop
    ("glm53.testing", "glm53.benchmarks"),  # oracles and benchmark logic (tooling, not modeling)
    ("glm53.ablation",),  # the quantization ablation: llama.cpp's statistics, imatrix, sweeps (tooling)
)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _layer(mod: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best:
                best, rank = len(pre), i
    if rank is None:
        raise AssertionError(f"{mod} is in no layer of tests/test_layering.py: add it to LAYERS")
    return rank


def _package(mod: str, path: pathlib.Path) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def _targets(node: ast.AST, mod: str, path: pathlib.Path) -> list[str]:
    """Project modules an import statement reaches (a `from A import b` reaches A.b when that is a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = _package(mod, path).split(".")
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join([*pkg, base] if base else pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for n in names:
        while n and n not in MODULES:
            n = n.rpartition(".")[0]
        if n and n.split(".")[0] in PACKAGES:
            out.append(n)
    return out


def _imports(mod: str, path: pathlib.Path):
    """(top-level targets, [(line, statement text, targets) for imports inside functions])."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines()
    top, inner = [], []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            f = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                t = _targets(child, mod, path)
                if in_function:
                    inner.append((child.lineno, lines[child.lineno - 1], lines[child.lineno - 2], t))
                elif not _type_checking(node):
                    top.extend(t)
            visit(child, f)

    visit(tree, False)
    return top, inner


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_point_down(mod):
    top, _ = GRAPH[mod]
    up = sorted({t for t in top if t != mod and _layer(t) > _layer(mod)})
    assert not up, f"{mod} (layer {_layer(mod)}) imports from higher layers: " + ", ".join(
        f"{t} (layer {_layer(t)})" for t in up
    )


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_function_level_imports_are_optional_dependencies_with_a_reason(mod):
    _, inner = GRAPH[mod]
    for lineno, line, prev, targets in inner:
        where = f"{MODULES[mod].relative_to(ROOT)}:{lineno}"
        assert not targets, (
            f"{where}: project import inside a function ({line.strip()}); import at module level"
        )
        assert "#" in line or prev.strip().startswith("#"), (
            f"{where}: an import inside a function needs a one-line reason as a comment ({line.strip()})"
        )


def test_no_import_cycles():
    edges = {m: sorted({t for t in GRAPH[m][0] if t != m}) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            dfs(m)


def test_the_checker_sees_violations(tmp_path):
    """The checker itself: a cycle and an upward import in a made-up graph are found."""
    assert _layer("glm53.layers.moe") > _layer("glm53.quant.planes") > _layer("glm53.config.model")
    assert _layer("glm53.quant.formats") < _layer("glm53.config")
    p = tmp_path / "m.py"
    p.write_text("from glm53.model import Glm53Model\ndef f():\n    import torch\n")
    MODULES["glm53.fake_for_test"] = p
    try:
        top, inner = _imports("glm53.fake_for_test", p)
        assert top == ["glm53.model"] and inner and not inner[0][3]
    finally:
        del MODULES["glm53.fake_for_test"]


def test_library_files_stay_under_500_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, f"library files over 500 lines: {long}"


# A markdown file named in a source or doc: a path relative to the repository root, e.g. docs/architecture.md.
_MD_CITATION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
# A markdown link's target, `](path)`: relative to its page (tests/test_docs_links.py checks it).
_MD_LINK_TARGET = re.compile(r"\]\([^)\s]*")


def test_no_references_outside_the_repository():
    """Sources and docs cite only files of the repository: no path into the folder next to it, and every
    markdown file they name exists at that path from the repository root (the model description is cited as
    docs/architecture.md)."""
    outside = ("../" + "shared", "shared/" + "spec")  # in pieces, so that this file does not contain them
    seen = _MD_CITATION.findall(
        "(see " + "architecture" + ".md §3, docs/architecture.md §5, https://x.org/a.md)"
    )
    assert seen == ["architecture" + ".md", "docs/architecture.md"]  # a bare name is caught, a URL is not
    bad = []
    for p in [
        *MODULES.values(),
        *ROOT.glob("experiments/*.py"),
        *ROOT.glob("configs/*.py"),
        *ROOT.glob("tests/*.py"),
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
    ]:
        text = p.read_text()
        where = p.relative_to(ROOT)
        bad += [f"{where}: {s!r}" for s in outside if s in text]
        # a markdown link's target is relative to its page: tests/test_docs_links.py checks those
        prose = _MD_LINK_TARGET.sub("](", text) if p.suffix == ".md" else text
        cited = sorted(set(_MD_CITATION.findall(prose)))
        bad += [f"{where}: {m!r} is not a file of the repository" for m in cited if not (ROOT / m).is_file()]
    assert not bad, "files citing material outside the repository:\n  " + "\n  ".join(bad)
