"""Findings and the report: what the doctor prints, and writes as doctor.txt / doctor.json / overfit.png."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["Finding", "Section", "Report", "stats", "fmt"]


@dataclass
class Finding:
    """One problem: ``name`` is stable (tests and scripts match on it), ``fix`` is one line for the user."""

    name: str
    level: str  # "FAIL" (training cannot work like this) or "WARN" (worth a look)
    stage: str
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.level} {self.name}: {self.message}\n     fix: {self.fix}"


@dataclass
class Section:
    """One stage of the report: ``data`` goes to doctor.json, ``lines`` to the terminal and doctor.txt."""

    title: str
    data: dict = field(default_factory=dict)
    lines: list = field(default_factory=list)
    findings: list = field(default_factory=list)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def flag(self, name: str, level: str, message: str, fix: str) -> Finding:
        f = Finding(name, level, self.title, message, fix)
        self.findings.append(f)
        return f


def fmt(v, digits: int = 4) -> str:
    """Numbers for the report: 4 significant digits, nan/inf spelled out."""
    if isinstance(v, float):
        return f"{v:.{digits}g}" if math.isfinite(v) else str(v)
    return str(v)


@torch.no_grad()
def stats(t: torch.Tensor) -> dict:
    """shape, dtype, min, max, mean, std and the count of non-finite values of a tensor (finite part)."""
    x = t.detach().float()
    finite = torch.isfinite(x)
    n_bad = int((~finite).sum())
    v = x[finite]
    out = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "nonfinite": n_bad}
    if v.numel():
        out.update(min=float(v.min()), max=float(v.max()), mean=float(v.mean()),
                   std=float(v.std()) if v.numel() > 1 else 0.0)
    else:
        out.update(min=float("nan"), max=float("nan"), mean=float("nan"), std=float("nan"))
    return out


def stats_line(s: dict) -> str:
    shape = "x".join(str(d) for d in s["shape"])
    return (f"{shape:<16} {s['dtype']:<8} min {fmt(s['min']):>9}  max {fmt(s['max']):>9}  "
            f"mean {fmt(s['mean']):>9}  std {fmt(s['std']):>9}  non-finite {s['nonfinite']}")


def _jsonable(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


@dataclass
class Report:
    sections: list
    header: list
    save_dir: Path | None = None

    @property
    def findings(self) -> list:
        return [f for s in self.sections for f in s.findings]

    @property
    def names(self) -> set:
        """The names of every finding, e.g. ``{"lr-zero", "overfit-failed"}``."""
        return {f.name for f in self.findings}

    @property
    def ok(self) -> bool:
        """True when no finding is a FAIL."""
        return not any(f.level == "FAIL" for f in self.findings)

    def section(self, title: str) -> Section | None:
        return next((s for s in self.sections if s.title == title), None)

    def text(self) -> str:
        out = list(self.header)
        for s in self.sections:
            out += ["", f"== {s.title} " + "=" * max(60 - len(s.title), 3)] + [f"  {x}" for x in s.lines]
        out += ["", "== findings " + "=" * 52]
        found = sorted(self.findings, key=lambda f: f.level != "FAIL")
        out += [f"  {f.line()}" for f in found] or ["  none: the trace, the overfit and the gradients look "
                                                     "healthy"]
        n_fail = sum(f.level == "FAIL" for f in found)
        out += ["", f"doctor: {'PASS' if self.ok else 'FAIL'} ({n_fail} failing, {len(found) - n_fail} "
                    f"warning{'s' if len(found) - n_fail != 1 else ''})"]
        return "\n".join(out)

    def to_dict(self) -> dict:
        return _jsonable({
            "ok": self.ok,
            "findings": [asdict(f) for f in self.findings],
            "sections": {s.title: s.data for s in self.sections},
        })

    def save(self, save_dir: str | Path) -> Path:
        """doctor.txt, doctor.json and (when the overfit ran) overfit.png in ``save_dir``."""
        d = Path(save_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.save_dir = d
        (d / "doctor.txt").write_text(self.text() + "\n", encoding="utf-8")
        (d / "doctor.json").write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        ov = self.section("overfit")
        if ov is not None and ov.data.get("losses"):
            plot_curve(ov.data["losses"], ov.data.get("threshold"), d / "overfit.png")
        return d


def plot_curve(losses, threshold, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers/CI; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, label="loss")
    if threshold is not None:
        ax.axhline(threshold, color="tab:red", ls="--", lw=1, label="pass below")
    ax.set_xlabel("step on one batch")
    ax.set_ylabel("total loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
