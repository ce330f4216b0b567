"""The GPU bundle: the wheels the GPU machine's image lacks, for CPython 3.12 manylinux x86-64, in ``.gpu/``.

    python scripts/gpu_bundle.py download                  # make gpu-bundle: .gpu/*.whl, the manifest, the size
    python scripts/gpu_bundle.py check                     # the pins, the manifest and the image agree (no network)
    python scripts/gpu_bundle.py install --target DIR      # on the GPU machine, offline: the wheels into DIR
    python scripts/gpu_bundle.py install --rehearse ...    # on a CPU: ``check``, and the cross-install where .gpu/ is

Three files say what the bundle is. ``scripts/gpu_wheels.txt`` pins one version of each wheel (written by hand).
``scripts/gpu_image.txt`` lists what the image holds (from the device tool's notes, versions where they were read).
``scripts/gpu_manifest.json`` is what ``download`` found for those pins: each wheel's file, size, sha256 and
requirements (``Requires-Dist``); ``download`` writes it and a copy into ``.gpu/``, and it is committed, so that
a machine without ``.gpu/`` (CI) still checks the real wheels' requirements against the image, and the machine
with it checks that the wheels it carries are those.

The machine that runs the check can reach no package registry, so everything is installed with
``pip install --no-index --no-deps --target``: what the pins miss fails there, at the price of a lent GPU. The
checks here find it first: every package the code needs (``pyproject.toml``'s dependencies and trl) is in the image
or pinned, every requirement of a bundled wheel is met by another bundled wheel or by the image, and the bundle
plus the tracked tree fits the 60 MiB that may travel with a call (the tool's limit is 64).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
PINS = REPO / "scripts" / "gpu_wheels.txt"
IMAGE = REPO / "scripts" / "gpu_image.txt"
MANIFEST = REPO / "scripts" / "gpu_manifest.json"
BUNDLE = REPO / ".gpu"
LIMIT_MIB = 60
MIB = 2**20
PYTHON_VERSION = "3.12"
# the manylinux tags pip may pick for CPython 3.12 on x86-64 (pip matches each exactly): the image's glibc is
# newer than all of these; bitsandbytes 0.50.2 ships manylinux_2_24 only
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
# the target's environment markers (Requires-Dist lines such as `; python_version < "3.9"`)
TARGET_MARKERS = {**default_environment(), "python_version": PYTHON_VERSION, "python_full_version": "3.12.3",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "os_name": "posix"}
EXTRA_NEEDS = ("trl",)  # what the check needs besides the project's dependencies: TRL's reference runs


class BundleError(Exception):
    """A problem with the bundle, said in one line."""


# ---- the three lists --------------------------------------------------------------------------------------------

def read_pins(text: str, where: str = "scripts/gpu_wheels.txt") -> dict[str, str]:
    """``NAME==VERSION`` lines (``#`` comments) -> {canonical name: version}.

    >>> read_pins("bitsandbytes==0.50.2  # nf4\\nTyping_Extensions==4.16.0\\n")
    {'bitsandbytes': '0.50.2', 'typing-extensions': '4.16.0'}
    """
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        try:
            Version(version.strip())
        except InvalidVersion:
            raise BundleError(f"{where}:{number}: expected NAME==VERSION, got {line!r}") from None
        if not sep or not name.strip() or " " in name.strip():
            raise BundleError(f"{where}:{number}: expected NAME==VERSION, got {line!r}")
        key = canonicalize_name(name.strip())
        if key in pins:
            raise BundleError(f"{where}:{number}: {key} is pinned twice (one version of each wheel)")
        pins[key] = version.strip()
    return pins


def read_image(text: str, where: str = "scripts/gpu_image.txt") -> dict[str, str | None]:
    """``NAME`` or ``NAME==VERSION`` lines -> {canonical name: version or None (not read)}.

    >>> read_image("torch==2.11.0\\nxxhash\\n")
    {'torch': '2.11.0', 'xxhash': None}
    """
    image: dict[str, str | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if " " in name.strip():
            raise BundleError(f"{where}:{number}: expected NAME or NAME==VERSION, got {line!r}")
        image[canonicalize_name(name.strip())] = version.strip() or None
    return image


def project_needs(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The packages the code needs on the GPU machine: ``pyproject.toml``'s dependencies and ``EXTRA_NEEDS``."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    return sorted({canonicalize_name(Requirement(d).name) for d in deps} | set(EXTRA_NEEDS))


# ---- the manifest -----------------------------------------------------------------------------------------------

def wheel_entry(path: Path) -> dict:
    """A wheel file -> its manifest entry: name, version, file, bytes, sha256, requires (its ``Requires-Dist``)."""
    name, version, _, tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        headers = HeaderParser().parsestr(z.read(meta).decode("utf-8"))
    return {"name": str(name), "version": str(version), "file": path.name, "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "tags": sorted(str(t) for t in tags), "requires": headers.get_all("Requires-Dist") or []}


def make_manifest(wheels: list[Path]) -> dict:
    entries = sorted((wheel_entry(w) for w in wheels), key=lambda e: e["name"])
    return {"python": PYTHON_VERSION, "platforms": list(PLATFORMS), "wheels": entries,
            "bytes": sum(e["bytes"] for e in entries)}


def read_manifest(path: Path = MANIFEST) -> dict:
    if not path.is_file():
        raise BundleError(f"{path.relative_to(REPO)} is missing: run `make gpu-bundle` (PyPI reachable) and commit it")
    return json.loads(path.read_text(encoding="utf-8"))


def pin_problems(pins: dict[str, str], manifest: dict) -> list[str]:
    """The pins against the manifest: one wheel per pin, of the pinned version, and no other wheel."""
    have = {canonicalize_name(e["name"]): e["version"] for e in manifest["wheels"]}
    problems = [f"{name}=={version} is pinned but the manifest has "
                f"{'no wheel of it' if name not in have else have[name]}: run `make gpu-bundle` and commit "
                "scripts/gpu_manifest.json" for name, version in pins.items() if have.get(name) != version]
    problems += [f"the manifest has {name} {version}, which scripts/gpu_wheels.txt does not pin: run `make "
                 "gpu-bundle`" for name, version in have.items() if name not in pins]
    return problems


def file_problems(bundle: Path, manifest: dict) -> list[str]:
    """``bundle``'s wheels against the manifest: each there with its sha256, no other wheel (two versions of one
    package stop the whole install)."""
    problems = []
    for e in manifest["wheels"]:
        path = bundle / e["file"]
        if not path.is_file():
            problems.append(f"{bundle.name}/{e['file']} is missing: run `make gpu-bundle`")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != e["sha256"]:
            problems.append(f"{bundle.name}/{e['file']} is not the wheel the manifest names (sha256 differs): run "
                            "`make gpu-bundle`")
    listed = {e["file"] for e in manifest["wheels"]}
    problems += [f"{bundle.name}/{p.name} is not in the manifest: run `make gpu-bundle` (it removes it)"
                 for p in sorted(bundle.glob("*.whl")) if p.name not in listed]
    return problems


# ---- what the wheels need ---------------------------------------------------------------------------------------

def requirement_report(manifest: dict, versions: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """Each bundled wheel's requirements (for CPython 3.12 on Linux x86-64; extras left out) against the bundle
    and ``versions`` (what the image holds: {name: version, or None where not read}) -> (problems, notes).

    A problem: a requirement nothing provides. A note: a version outside the requirement's range (pip's metadata
    is often stricter than the code: the imports, run next, decide), or the packages whose version was not read
    (one note naming them; on the GPU machine every version is read).
    """
    bundled = {canonicalize_name(e["name"]): e["version"] for e in manifest["wheels"]}
    problems, notes, unread = [], [], set()
    for e in manifest["wheels"]:
        for line in e["requires"]:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                problems.append(f"{e['name']} {e['version']}: cannot read its requirement {line!r}")
                continue
            if req.marker is not None and not req.marker.evaluate({**TARGET_MARKERS, "extra": ""}):
                continue
            name = canonicalize_name(req.name)
            if name in bundled:
                version, where = bundled[name], "bundled"
            elif name in versions:
                version, where = versions[name], "in the image"
            else:
                problems.append(f"{e['name']} {e['version']} needs {req}, which neither the image holds nor "
                                "scripts/gpu_wheels.txt pins")
                continue
            spec = SpecifierSet(str(req.specifier))
            if not str(spec):
                continue
            if version is None:
                unread.add(name)
            elif not spec.contains(version, prereleases=True):
                notes.append(f"{e['name']} needs {req}: {name} {version} is {where}")
    if unread:
        notes.append(f"versions not read, so not compared with what the wheels need: {', '.join(sorted(unread))}")
    return problems, notes


def coverage_problems(needs: list[str], pins: dict[str, str], image: dict[str, str | None]) -> list[str]:
    """A package the code needs that neither the image holds nor the pins bring."""
    return [f"{name} is needed (pyproject.toml, or {', '.join(EXTRA_NEEDS)} for the reference runs) but neither the "
            "GPU image holds it (scripts/gpu_image.txt) nor scripts/gpu_wheels.txt pins it"
            for name in needs if name not in pins and name not in image]


def installed_versions(paths: list[str]) -> dict[str, str]:
    """{canonical name: version} of the distributions on ``paths`` (the first one found wins, as imports do)."""
    from importlib.metadata import distributions

    found: dict[str, str] = {}
    for dist in distributions(path=paths):
        found.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist.version)
    return found


# ---- size ---------------------------------------------------------------------------------------------------------

def tracked_bytes(repo: Path = REPO) -> int:
    """The bytes of the tracked tree (``git ls-files``): what travels with a device call besides ``carry``."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BundleError(f"cannot list the tracked tree with git ({exc}): the size check needs a git checkout") \
            from None
    names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
    return sum((repo / n).stat().st_size for n in names if (repo / n).is_file())


def size_problem(bundle_bytes: int, tree_bytes: int, limit_mib: int = LIMIT_MIB) -> str | None:
    """None, or the line saying that the bundle and the tree exceed ``limit_mib``.

    >>> size_problem(50 * MIB, 3 * MIB)
    >>> size_problem(59 * MIB, 3 * MIB)
    'the bundle (59.0 MiB) and the tracked tree (3.0 MiB) make 62.0 MiB, over the 60 MiB that may travel'
    """
    total = bundle_bytes + tree_bytes
    if total <= limit_mib * MIB:
        return None
    return (f"the bundle ({bundle_bytes / MIB:.1f} MiB) and the tracked tree ({tree_bytes / MIB:.1f} MiB) make "
            f"{total / MIB:.1f} MiB, over the {limit_mib} MiB that may travel")


# ---- commands -----------------------------------------------------------------------------------------------------

def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join(line for line in proc.stderr.splitlines() if line.startswith("ERROR"))[-800:]
        raise BundleError(f"pip {args[0]} failed (exit {proc.returncode}): {tail or proc.stderr[-800:]}")


def platform_args() -> list[str]:
    return ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
            *(a for p in PLATFORMS for a in ("--platform", p))]


def download(bundle: Path = BUNDLE, pins_path: Path = PINS, manifest_path: Path = MANIFEST) -> dict:
    """``make gpu-bundle``: every pinned wheel into ``bundle`` (pip keeps one already there), the others removed,
    the manifest written here and beside them; ``BundleError`` when the bundle and the tree exceed the limit."""
    pins = read_pins(pins_path.read_text(encoding="utf-8"))
    bundle.mkdir(exist_ok=True)
    pip("download", "--quiet", "--no-deps", *platform_args(), "--dest", str(bundle),
        *(f"{name}=={version}" for name, version in pins.items()))
    wheels = {}
    for path in sorted(bundle.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        if pins.get(canonicalize_name(name)) == str(version):
            wheels.setdefault(canonicalize_name(name), []).append(path)
        else:
            path.unlink()  # an earlier pin's wheel: two versions of one package stop the install
    twice = [paths for paths in wheels.values() if len(paths) > 1]
    if twice:
        raise BundleError(f"pip left several wheels of one pin: {', '.join(p.name for p in twice[0])}")
    missing = sorted(set(pins) - set(wheels))
    if missing:
        raise BundleError(f"pip downloaded no wheel of {', '.join(missing)}")
    manifest = make_manifest([paths[0] for paths in wheels.values()])
    text = json.dumps(manifest, indent=1) + "\n"
    manifest_path.write_text(text, encoding="utf-8")
    (bundle / "manifest.json").write_text(text, encoding="utf-8")
    bundle_bytes = sum(p.stat().st_size for p in bundle.iterdir() if p.is_file())
    problem = size_problem(bundle_bytes, tracked_bytes())
    if problem:
        raise BundleError(problem)
    return manifest


def check(bundle: Path | None = None, *, image_versions: dict[str, str | None] | None = None) -> dict:
    """The pins, the manifest, the image and the size agree (and ``bundle``'s wheels, where it is there) ->
    a report {problems, notes, wheels, bundle_bytes, tree_bytes}; no network, no install."""
    bundle = BUNDLE if bundle is None else bundle
    pins = read_pins(PINS.read_text(encoding="utf-8"))
    image = read_image(IMAGE.read_text(encoding="utf-8"))
    manifest = read_manifest()
    problems = pin_problems(pins, manifest) + coverage_problems(project_needs(), pins, image)
    present = bundle.is_dir() and any(bundle.glob("*.whl"))
    if present:
        problems += file_problems(bundle, manifest)
    reqs, notes = requirement_report(manifest, image if image_versions is None else image_versions)
    problems += reqs
    report = {"problems": problems, "notes": notes, "bundle_present": present,
              "wheels": [f"{e['name']}=={e['version']}" for e in manifest["wheels"]], "bundle_bytes": manifest["bytes"]}
    if (REPO / ".git").exists():  # a checkout (a device machine's copy of the tree has no git: nothing to size)
        try:
            report["tree_bytes"] = tracked_bytes()
        except BundleError as exc:
            notes.append(f"the size was not checked: {exc}")
        else:
            problem = size_problem(manifest["bytes"], report["tree_bytes"])
            if problem:
                problems.append(problem)
    return report


def install(target: Path, bundle: Path | None = None, *, rehearse: bool = False) -> dict:
    """The GPU machine's install step: ``check``, then every wheel into ``target`` offline (``pip install
    --no-index --no-deps --target``), then each wheel's requirements against what is installed here (``target``
    first, then the image's own packages). ``rehearse`` (a CPU, another Python): where ``bundle`` is there, the
    same install for CPython 3.12 manylinux into ``target`` (pip's cross-install, nothing imported from it);
    where it is not, ``check`` alone."""
    bundle = BUNDLE if bundle is None else bundle
    report = check(bundle)
    if report["problems"]:
        return report
    manifest = read_manifest()
    if not report["bundle_present"]:
        if not rehearse:
            report["problems"].append(f"{bundle.name}/ is missing: run `make gpu-bundle` where PyPI is reachable, "
                                      f"and carry {bundle.name} with the call")
        else:
            report["installed"] = "skipped: no .gpu/ here; checked against the manifest"
        return report
    if target.exists():
        shutil.rmtree(target)
    pip("install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--disable-pip-version-check",
        "--target", str(target), *(platform_args() if rehearse else ()),
        *(str(bundle / e["file"]) for e in manifest["wheels"]))
    report["installed"] = str(target)
    if not rehearse:  # this Python reads what is installed: the target first, then the image
        versions = installed_versions([str(target), *sys.path])
        problems, notes = requirement_report(manifest, dict(versions))
        report["problems"] += problems
        report["notes"] = notes
        report["installed_versions"] = {canonicalize_name(e["name"]): versions.get(canonicalize_name(e["name"]))
                                        for e in manifest["wheels"]}
    return report


def print_report(report: dict) -> None:
    print(f"bundle: {len(report['wheels'])} wheels, {report['bundle_bytes'] / MIB:.1f} MiB"
          + (f" + tracked tree {report['tree_bytes'] / MIB:.1f} MiB (limit {LIMIT_MIB} MiB)"
             if "tree_bytes" in report else "")
          + ("" if report["bundle_present"] else "; .gpu/ absent here"))
    if "installed" in report:
        print(f"installed: {report['installed']}")
    for note in report["notes"]:
        print(f"note: {note}")
    for problem in report["problems"]:
        print(f"error: {problem}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("download", help="make gpu-bundle: the pinned wheels into .gpu/, the manifest, the size check")
    sub.add_parser("check", help="the pins, the manifest, the image and the size agree (and .gpu/ where it is)")
    inst = sub.add_parser("install", help="the GPU machine's install step (offline)")
    inst.add_argument("--target", required=True, type=Path, help="where the wheels go (then on PYTHONPATH)")
    inst.add_argument("--rehearse", action="store_true", help="a CPU rehearsal: cross-install or check only")
    inst.add_argument("--report", type=Path, help="also write the report here as JSON")
    args = ap.parse_args(argv)
    began = time.perf_counter()
    try:
        if args.command == "download":
            manifest = download()
            for e in manifest["wheels"]:
                print(f"{e['bytes'] / MIB:7.2f} MiB  {e['file']}")
            print(f"{manifest['bytes'] / MIB:7.2f} MiB  in {BUNDLE.name}/ ({len(manifest['wheels'])} wheels); with the "
                  f"tracked tree {(manifest['bytes'] + tracked_bytes()) / MIB:.1f} MiB of {LIMIT_MIB}; manifest "
                  f"{MANIFEST.relative_to(REPO)}")
            return 0
        report = check() if args.command == "check" else install(args.target, rehearse=args.rehearse)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report["seconds"] = round(time.perf_counter() - began, 1)
    if getattr(args, "report", None):
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print_report(report)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
