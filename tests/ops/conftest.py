import pytest

from yolofast.ops import _build


@pytest.fixture(scope="module")
def lib():
    """``yolofast.ops._library`` (the compiled ops), or skip when the C++ extension did not build."""
    ok, why = _build.extension_status("cpp")
    if not ok:
        pytest.skip(f"C++ extension unavailable ({why}); tests/ops/test_build.py reports the failure")
    from yolofast.ops import _library

    return _library
