import pytest
from crafted import ULTRALYTICS


@pytest.fixture
def ultralytics_dir():
    if not (ULTRALYTICS / "yolov8n-rect3.pt").is_file():
        pytest.skip(f"the Ultralytics reference files are not at {ULTRALYTICS} (see its SOURCE.md)")
    return ULTRALYTICS
