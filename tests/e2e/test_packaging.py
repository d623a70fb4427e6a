"""The wheel ships every package of the source tree: pyproject.toml lists its packages by hand (passes/ maps to
apex_compile.passes), so a new subpackage left out of the list would import from a checkout and fail installed."""
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pyproject_lists_every_package_of_the_tree():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapped = {os.path.normpath(d): name for name, d in setuptools.get("package-dir", {}).items()}
    found = set()
    for top in ("apex_compile", *mapped):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
            if "__init__.py" not in filenames:
                continue
            parts = os.path.normpath(os.path.relpath(dirpath, ROOT)).split(os.sep)
            base = mapped.get(parts[0], parts[0])  # a mapped top folder takes its package's name
            found.add(".".join([base] + parts[1:]))
    assert "apex_compile.runtime.plans" in found and "apex_compile.passes" in found
    assert found == listed, f"pyproject.toml's packages miss {sorted(found - listed)}, list extra {sorted(listed - found)}"
