"""Keeps the Helm chart (charts/goodput) and manifests/ one source of truth, and packages the chart.

    python3 hack/chart.py sync            copy crds/*.yaml into the chart's crds/ and the monitoring
                                          objects into its files/monitoring/, stamp the version into
                                          Chart.yaml, and render manifests/*.yaml from the templates
    python3 hack/chart.py check           the same, writing nothing: exits 1 naming each stale file
    python3 hack/chart.py package [--destination DIR]
                                          sync's check, then the chart's .tgz (Helm's own packager)

The chart is the source: manifests/ holds its templates rendered with the default values into the
namespace goodput-system, one file per template, so `kubectl apply -k manifests/` installs what
`helm install` does. CRDs are edited in crds/ only; the chart's copies follow. Rendering, linting
and packaging use Helm's own library (the helm-python-sdk package).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "goodput"
MANIFESTS = ROOT / "manifests"
NAMESPACE = "goodput-system"
RELEASE = "goodput"
# The templates whose default rendering is manifests/<same name>; monitoring.yaml renders nothing by default.
RENDERED = (
    "namespace.yaml",
    "service_account.yaml",
    "rbac.yaml",
    "operator.yaml",
    "gateway-rbac.yaml",
    "gateway.yaml",
    "gateway-batch.yaml",
)
MONITORING = ("gateway-servicemonitor.yaml", "prometheus-rule.yaml", "dashboard-configmap.yaml")


def version() -> str:
    text = (ROOT / "contract" / "goodput_contract" / "version.py").read_text()
    match = re.search(r'^VERSION = "([^"]+)"$', text, re.M)
    assert match, "contract/goodput_contract/version.py has no VERSION"
    return match[1]


def header(template: str) -> str:
    return (
        f"# Rendered from charts/goodput/templates/{template} with the chart's default values by\n"
        "# `python3 hack/chart.py sync`: edit the template, then run that, never this file.\n"
    )


def render_defaults() -> dict[str, str]:
    """Template file name -> its text rendered with the default values (Helm's own renderer)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(name=RELEASE, namespace=NAMESPACE, is_install=True)
    return {Path(path).name: text for path, text in rendered.items()}


def chart_yaml(text: str, ver: str) -> str:
    text = re.sub(r"^version: .*$", f"version: {ver}", text, count=1, flags=re.M)
    return re.sub(r"^appVersion: .*$", f'appVersion: "{ver}"', text, count=1, flags=re.M)


def wanted() -> dict[Path, str]:
    """Every derived file and the text it must have."""
    files: dict[Path, str] = {}
    chart_file = CHART / "Chart.yaml"
    files[chart_file] = chart_yaml(chart_file.read_text(), version())
    for crd in sorted((ROOT / "crds").glob("*.yaml")):
        if crd.name != "kustomization.yaml":
            files[CHART / "crds" / crd.name] = crd.read_text()
    for name in MONITORING:
        files[CHART / "files" / "monitoring" / name] = (MANIFESTS / "monitoring" / name).read_text()
    return files


def rendered_manifests() -> dict[Path, str]:
    rendered = render_defaults()
    return {MANIFESTS / name: header(name) + rendered[name].strip() + "\n" for name in RENDERED}


def stale(files: dict[Path, str]) -> list[Path]:
    return [path for path, text in files.items() if not path.exists() or path.read_text() != text]


def extra_crds() -> list[Path]:
    """Copies in the chart whose CRD is gone from crds/."""
    sources = {p.name for p in (ROOT / "crds").glob("*.yaml")}
    return [p for p in (CHART / "crds").glob("*.yaml") if p.name not in sources]


def sync() -> None:
    # the copies and Chart.yaml first: the rendering reads them
    for path, text in wanted().items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in extra_crds():
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    for path, text in rendered_manifests().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")


def check() -> list[str]:
    """The derived files that differ from what sync would write, as messages."""
    problems = [f"{p.relative_to(ROOT)} is out of date" for p in stale(wanted())]
    problems += [f"{p.relative_to(ROOT)} has no source in crds/" for p in extra_crds()]
    problems += [f"{p.relative_to(ROOT)} is out of date" for p in stale(rendered_manifests())]
    return problems


def package(destination: Path) -> Path:
    import helm_python as helm

    destination.mkdir(parents=True, exist_ok=True)
    return Path(helm.package(CHART, destination=destination))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/chart.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sync")
    sub.add_parser("check")
    pack = sub.add_parser("package")
    pack.add_argument("--destination", type=Path, default=ROOT / "dist")
    args = parser.parse_args(argv)
    if args.command == "sync":
        sync()
        return 0
    problems = check()
    for problem in problems:
        print(f"{problem}: run `python3 hack/chart.py sync`", file=sys.stderr)
    if problems:
        return 1
    if args.command == "package":
        print(package(args.destination))
    return 0


if __name__ == "__main__":
    sys.exit(main())
