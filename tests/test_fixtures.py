"""fixtures/ rebuilds every test checkpoint byte for byte, so a failure can be reproduced anywhere."""

from fixtures.build import build_all
from fixtures.models import FAMILY_CASES, folder_digest


def test_fixture_build_is_deterministic_and_small(tmp_path):
    first, second = build_all(tmp_path / "a"), build_all(tmp_path / "b")
    assert set(first) == set(second)
    assert {f"families/{case.name}" for case in FAMILY_CASES} <= set(first)
    for name in first:
        assert folder_digest(first[name]) == folder_digest(second[name]), name
    total = sum(p.stat().st_size for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert total < 4_000_000  # kilobytes per checkpoint, not megabytes
