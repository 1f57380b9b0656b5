"""docs/metrics.md's table as data, and the metric names and label matchers a PromQL text uses.

The table is the contract between kvpackd, the alert rules and the dashboard; these helpers let
tests hold each of them to it.
"""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "metrics.md"

# Labels every scraped series may carry besides its own: added by Prometheus or by the scrape
# configurations in deploy/ (prometheus.yml, ServiceMonitor, PodMonitor).
TARGET_LABELS = {"job", "instance", "gpu", "pod", "namespace", "node", "service", "container",
                 "endpoint"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class Family:
    def __init__(self, name, kind, labels):
        self.name = name
        self.kind = kind            # gauge | counter | histogram
        self.labels = labels        # label -> set of values, or None when the set is open

    def __repr__(self):
        return f"Family({self.name}, {self.kind}, {self.labels})"


def _parse_labels(cell):
    cell = re.sub(r"\([^)]*\)", "", cell)  # "(gRPC code name, e.g. `OK`)" gives examples only
    labels = {}
    for m in re.finditer(r"`(\w+)`\s*(?:=\s*((?:`\w+`\s*,?\s*)+))?", cell):
        values = re.findall(r"`(\w+)`", m.group(2)) if m.group(2) else None
        labels[m.group(1)] = set(values) if values else None
    return labels


def families(path=METRICS_DOC):
    """{name: Family} from the markdown table (rows whose first cell is a backticked name)."""
    out = {}
    for line in pathlib.Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"`kvpack_\w+`", cells[0]):
            continue
        name = cells[0].strip("`")
        kind = cells[1].split()[0]
        out[name] = Family(name, kind, _parse_labels(cells[2]))
    return out


def resolve(name, fams):
    """(family, suffix) for a sample name such as kvpack_x_bucket, or (None, None)."""
    if name in fams:
        return fams[name], ""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and base in fams and fams[base].kind == "histogram":
            return fams[base], suffix
    return None, None


_SELECTOR = re.compile(r"\b(kvpack_[a-z0-9_]+)\b\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def metric_names(expr):
    """Sample names (kvpack_*) an expression reads; recording-rule names (with ':') excluded."""
    return {m.group(1) for m in _SELECTOR.finditer(expr)}


def problems(expr, fams):
    """Every way `expr` departs from the contract, as readable strings (empty when it conforms)."""
    out = []
    for m in _SELECTOR.finditer(expr):
        name, braces = m.group(1), m.group(2) or ""
        fam, suffix = resolve(name, fams)
        if fam is None:
            out.append(f"{name}: not in docs/metrics.md")
            continue
        allowed = set(fam.labels) | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        for label, op, value in _MATCHER.findall(braces):
            if label not in allowed:
                out.append(f"{name}: label {label!r} is not documented")
            elif op == "=" and fam.labels.get(label) and value not in fam.labels[label]:
                out.append(f"{name}: {label}={value!r} is not one of {sorted(fam.labels[label])}")
    all_labels = set(TARGET_LABELS) | {"le"}
    for fam in fams.values():
        all_labels |= set(fam.labels)
    for m in _GROUPING.finditer(expr):
        for label in filter(None, (l.strip() for l in m.group(1).split(","))):
            if label not in all_labels:
                out.append(f"grouping label {label!r} is on no documented family")
    return out


def parse_exposition(text):
    """{family: type} and the set of sample names from a Prometheus text exposition."""
    types, samples = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            samples.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return types, samples
