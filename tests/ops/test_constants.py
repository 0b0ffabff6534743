"""The numbers every kernel shares with the reference are defined once per language and agree:
kernels/_constants.py (the reference and the Triton kernels) and csrc/common/constants.h (the C++/CUDA
kernels). A literal copy elsewhere in csrc/ or kernels/ could drift from the spec by one edit, so it fails.

Reads text only: no build, no torch.
"""

import math
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "csrc" / "common" / "constants.h"
PY_CONSTANTS = REPO / "kernels" / "_constants.py"

# C++ name -> Python name
PAIRS = {"kCiouEps": "CIOU_EPS", "kFourOverPi2": "FOUR_OVER_PI2", "kSmallGtSide": "SMALL_GT_SIDE"}

# The literals that are these constants (comments are stripped before matching, so prose may name them):
# 1e-7 in any spelling, 4/pi^2 as a number or as 4/(pi*pi), and the 16 px side as a floating literal.
FORBIDDEN = {
    "CIoU eps": re.compile(r"(?<![\w.])(?:1(?:\.0*)?[eE]-0*7|0\.0000001)(?![\d])"),
    "4/pi^2": re.compile(
        r"0\.40528|\bM_PI\s*\*\s*M_PI\b|math\.pi\s*\*\*\s*2|4(?:\.0*)?\s*/\s*\(?\s*(?:M_PI|math\.pi)"
    ),
    "small-GT side": re.compile(r"(?<![\w.])16\.0*(?:[fF]|(?![\deE]))"),
}


def _header_values() -> dict[str, float]:
    text = HEADER.read_text()
    found = dict(re.findall(r"constexpr\s+double\s+(k\w+)\s*=\s*([0-9.eE+-]+)\s*;", text))
    assert set(PAIRS) <= set(found), f"{HEADER.name}: expected constexpr double {sorted(PAIRS)}, got {found}"
    return {name: float(found[name]) for name in PAIRS}


def _python_values() -> dict[str, float]:
    ns: dict = {}
    exec(compile(PY_CONSTANTS.read_text(), str(PY_CONSTANTS), "exec"), ns)  # imports only math
    return {py: ns[py] for py in PAIRS.values()}


def test_header_includes_nothing():
    # usable from host, device and emulated code alike, and from any layer
    assert not re.search(r"^\s*#\s*include", HEADER.read_text(), re.M)


@pytest.mark.parametrize("cpp", sorted(PAIRS))
def test_header_equals_python(cpp):
    # the same double, bit for bit: float() of the header's literal is what the C++ compiler rounds it to
    assert _header_values()[cpp] == _python_values()[PAIRS[cpp]], cpp


def test_four_over_pi2_is_the_nearest_double():
    assert _python_values()["FOUR_OVER_PI2"] == 4.0 / math.pi**2


def _strip_comments(text: str, suffix: str) -> str:
    if suffix == ".py":
        return "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def _sources():
    for p in sorted((REPO / "csrc").rglob("*")):
        if p.suffix in (".h", ".cuh", ".cpp", ".cu") and p != HEADER:
            yield p
    for p in sorted((REPO / "kernels").glob("*.py")):
        if p != PY_CONSTANTS:
            yield p


def test_no_copies_of_the_constants():
    bad = []
    for p in _sources():
        code = _strip_comments(p.read_text(), p.suffix)
        for i, line in enumerate(code.splitlines(), 1):
            bad += [f"{p.relative_to(REPO)}:{i}: {what}: {line.strip()}" for what, rx in FORBIDDEN.items()
                    if rx.search(line)]
    assert not bad, "use csrc/common/constants.h or kernels/_constants.py instead:\n" + "\n".join(bad)


COPIES = ["const T eps = T(1e-7);", "x = 1.0e-07", "k = 4.0 / (M_PI * M_PI)", "K = 0.40528473456935108578",
          "side = 16.0f", "side = 16.", "K = 4 / math.pi**2"]


@pytest.mark.parametrize("line", COPIES)
def test_the_scan_would_see_a_copy(line):
    assert any(rx.search(line) for rx in FORBIDDEN.values()), line


@pytest.mark.parametrize("line", ["int n = 16;", "x * 1e-9", "kGrain = 1 << 16", "eps = 1e-70", "y = 116.0",
                                  "T(kCiouEps)", "a = 0.16", "b = 16.5"])
def test_the_scan_lets_other_numbers_be(line):
    assert not any(rx.search(line) for rx in FORBIDDEN.values()), line
