"""The fault-injection suite, short (`make soak` runs it long: `python -m tests.soak`)."""

from tests import soak


def test_faults_short(tmp_path):
    report = soak.run(scale=0.1, tmp=tmp_path, progress=lambda _: None)
    print(report.table())
    assert not report.lost
    assert report.checks == report.checks_passed >= 8
    for kind in ("allocator SIGKILL", "redis SIGKILL", "redis SIGKILL (--require-persistence)",
                 "client disconnect mid-Step", "deadline expiry", "message flood to the size limit"):
        assert report.faults[kind] >= 1, kind
    assert report.probe["samples"] >= 200
