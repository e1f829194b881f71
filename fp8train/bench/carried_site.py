"""The carried pure-Python wheels (.gpu_site, from scripts/prepare_gpu_wheels.sh), minus what the GPU image has.

Everything on PYTHONPATH comes before site-packages, so putting the whole carried folder there would make its
pytest, pluggy and packaging shadow the image's own, which then load the image's pytest plugins, built for another
pytest. `python -m fp8train.bench.carried_site SITE DEST` (scripts/gpu_check.sh runs it before SITE is on the
path) links into DEST only the distributions of SITE that this interpreter cannot find, whole (package folders,
modules and the .dist-info, as each wheel's RECORD lists them), and prints DEST for PYTHONPATH.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

__all__ = ["carried_distributions", "link_missing"]


def carried_distributions(site: Path) -> dict[str, set[str]]:
    """{distribution name: the top-level entries of `site` its wheel installed} from each .dist-info's RECORD."""
    found = {}
    for info in sorted(site.glob("*.dist-info")):
        name = info.name[: -len(".dist-info")].rsplit("-", 1)[0]
        record = info / "RECORD"
        rows = record.read_text().splitlines() if record.is_file() else []
        tops = {row.split(",", 1)[0].split("/", 1)[0] for row in rows if row.strip()}
        found[name] = {top for top in tops if top and not top.endswith(".data")} | {info.name}
    return found


def _installed_here(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def link_missing(site: Path, dest: Path) -> list[str]:
    """Symlink into `dest` the entries of every carried distribution this interpreter lacks; their names."""
    dest.mkdir(parents=True, exist_ok=True)
    linked = []
    for name, entries in carried_distributions(site).items():
        if _installed_here(name):
            continue
        for entry in sorted(entries):
            source, target = site / entry, dest / entry
            if source.exists() and not target.exists():
                target.symlink_to(source.resolve())
        linked.append(name)
    return linked


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m fp8train.bench.carried_site SITE DEST", file=sys.stderr)
        return 2
    site, dest = Path(argv[0]), Path(argv[1])
    linked = link_missing(site, dest)
    print(f"carried_site: from {site}: {', '.join(linked) or 'nothing'} (the image has the rest)", file=sys.stderr)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
