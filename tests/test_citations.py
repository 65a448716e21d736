"""Every file the code and the docs cite exists, and every cited section of a document is a
heading in it: a newcomer following a reference never lands on nothing."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOP = r"(?:docs|dynar|pyx|include|perf|tests|tools|examples|\.ci)"
_PACKAGES = r"(?:dist|nn|train|data|models|optim|kernels)"
_ENDINGS = r"(?:py|pyx|pxd|h|c|md|json|png|sh|sbatch|toml|txt)"
# docs/DESIGN.md, or dist/sync.py (inside the package: dynar/dist/sync.py)
_PATH = re.compile(rf"(?<![\w./-])((?:{_TOP}|{_PACKAGES})/[\w./-]*?\.{_ENDINGS})(?![\w/])")
# a document's path, then a comma or 's and a section's name in double quotes
_SECTION = re.compile(r"((?:docs/)?[\w./-]+\.md)(?:, |'s )\"([^\"]+)\"")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.splitlines() if not f.startswith("perf/results/")
            and os.path.exists(os.path.join(ROOT, f))]


def _exists(cited, citing):
    candidates = [cited, os.path.join("dynar", cited),
                  os.path.normpath(os.path.join(os.path.dirname(citing), cited))]
    return any(os.path.exists(os.path.join(ROOT, c)) for c in candidates)


def _headings(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return {line.lstrip("#").strip().strip("`") for line in f if line.startswith("#")}


def _citations():
    for path in _tracked_files():
        if not path.endswith((".py", ".pyx", ".pxd", ".h", ".c", ".md", ".sh", ".toml")) \
                and os.path.basename(path) not in ("run",):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for match in _PATH.finditer(text):
            yield path, "file", match.group(1).rstrip(".")
        for match in _SECTION.finditer(text):
            yield path, "section", (match.group(1), match.group(2))
        if path.endswith(".md"):
            for match in _LINK.finditer(text):
                if not re.match(r"[a-z]+:", match.group(1)):
                    yield path, "link", match.group(1)


def test_cited_files_and_sections_exist():
    missing = []
    for citing, kind, cited in _citations():
        if kind in ("file", "link"):
            # A name a command writes (a trace, a result) or a pattern is not a citation.
            if "*" in cited or "<" in cited or cited.startswith(("perf/results/",)):
                continue
            if not _exists(cited, citing):
                missing.append(f"{citing}: {cited}")
        else:
            doc, section = cited
            doc = doc if doc.startswith("docs/") or "/" in doc else f"docs/{doc}"
            if not os.path.exists(os.path.join(ROOT, doc)):
                missing.append(f"{citing}: {doc}")
            elif not any(section in heading for heading in _headings(doc)):
                missing.append(f"{citing}: {doc} has no section {section!r}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(sorted(set(missing)))


def _modules():
    """dynar's module basenames -> [importable names] (Python modules, Cython kernels)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "dynar")):
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for name in files:
            stem, ending = os.path.splitext(name)
            if ending == ".py" and stem not in ("__init__", "__main__"):
                found.setdefault(stem, []).append(f"{package}.{stem}")
    for name in os.listdir(os.path.join(ROOT, "pyx")):
        stem, ending = os.path.splitext(name)
        if ending == ".pyx" and stem != "allreduce":     # allreduce: dist/_allreduce, MPI
            found.setdefault(stem, []).append(f"dynar.kernels.{stem}")
    return found


def _prose(path, text):
    """What a person wrote in `path` about the code: a Markdown file's text outside its code
    blocks, the comments of code."""
    if path.endswith(".md"):
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        return "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    marker = "//" if path.endswith((".h", ".c")) else "#"
    return "\n".join(line.split(marker, 1)[1] for line in text.splitlines() if marker in line)


def test_cited_names_exist():
    import importlib
    modules = _modules()
    pattern = re.compile(rf"(?<![\w.])({'|'.join(sorted(modules, key=len, reverse=True))})"
                         r"\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")
    missing = []
    for path in _tracked_files():
        # The notes are history: they name the code as it was when they were written.
        if not path.endswith((".py", ".pyx", ".pxd", ".h", ".c", ".md")) \
                or path.startswith("docs/notes/"):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            prose = _prose(path, f.read())
        for match in pattern.finditer(prose):
            stem, name, member = match.groups()
            if name in ("py", "pyx", "pxd", "h", "md", "json", "so", "gz"):
                continue            # a file name, checked above
            values = [getattr(importlib.import_module(m), name, None) for m in modules[stem]]
            if not any(v is not None and (not member or hasattr(v, member)) for v in values):
                missing.append(f"{path}: {match.group(0)}")
    assert not missing, "cited but not defined:\n" + "\n".join(sorted(set(missing)))
