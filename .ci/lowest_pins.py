"""Pins each direct dependency of chatd to the lowest release its pyproject specifier allows.

Reads [project] dependencies and one extra of [project.optional-dependencies] and prints one
`name==version` line per dependency: a pip constraints file. "Lowest" means the oldest final
release that satisfies the specifier and has a wheel this interpreter can install (its tags and
its Requires-Python), so the floor that is tested is one a user's pip would really take.
`--hold name==version` pins a dependency to a given release instead (one whose lowest release
cannot be installed here); the held release must still satisfy the specifier.

It knows nothing about transitive dependencies (pip resolves those, newest first, as a user's
pip would) and asks only the package index's JSON simple API (PEP 691), one request a name.
Needs `packaging`; run it with the interpreter the pins are for.
"""

import argparse
import json
import sys
import tomllib
import urllib.request

from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def direct_requirements(pyproject_path: str, extra: str) -> list[Requirement]:
    """The [project] dependencies and the named extra's, those whose markers hold here."""
    with open(pyproject_path, "rb") as f:
        project = tomllib.load(f)["project"]
    listed = project.get("dependencies", []) + project.get("optional-dependencies", {}).get(extra, [])
    requirements = [Requirement(line) for line in listed]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": extra})]


def installable_versions(index_url: str, name: str) -> set[Version]:
    """Versions of `name` on the index with at least one wheel this interpreter can install."""
    request = urllib.request.Request(f"{index_url.rstrip('/')}/{canonicalize_name(name)}/",
                                     headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    supported_tags = set(sys_tags())
    python_version = Version(".".join(map(str, sys.version_info[:3])))
    versions = set()
    for file in files:
        if not file["filename"].endswith(".whl") or file.get("yanked"):
            continue
        requires_python = file.get("requires-python")
        if requires_python and python_version not in Requirement(f"x{requires_python}").specifier:
            continue
        try:
            _, version, _, tags = parse_wheel_filename(file["filename"])
        except (ValueError, InvalidVersion):  # an old upload with a name pip would not take either
            continue
        if tags & supported_tags:
            versions.add(version)
    return versions


def lowest_version(requirement: Requirement, index_url: str) -> Version:
    """The oldest installable final release that satisfies the requirement's specifier."""
    candidates = sorted(requirement.specifier.filter(installable_versions(index_url, requirement.name)))
    if not candidates:
        sys.exit(f"lowest_pins: no installable wheel of {requirement} for this interpreter")
    return candidates[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", default="pyproject.toml")
    parser.add_argument("--extra", default="dev", help="the optional-dependencies group to include")
    parser.add_argument("--index-url", default="https://pypi.org/simple")
    parser.add_argument("--hold", action="append", default=[], metavar="NAME==VERSION",
                        help="pin this dependency to this release instead of its lowest")
    args = parser.parse_args()

    held = {}
    for pin in args.hold:
        name, _, version = pin.partition("==")
        held[canonicalize_name(name)] = Version(version)
    for requirement in direct_requirements(args.pyproject, args.extra):
        name = canonicalize_name(requirement.name)
        if name in held:
            version = held.pop(name)
            if version not in requirement.specifier:
                sys.exit(f"lowest_pins: held {name}=={version} is outside pyproject's {requirement}")
        else:
            version = lowest_version(requirement, args.index_url)
        print(f"{name}=={version}")
    if held:
        sys.exit(f"lowest_pins: held {', '.join(held)} not among the direct dependencies")


if __name__ == "__main__":
    main()
