"""infra/pip_stepwise.py: the plan it makes from pip's install report (a hand-made report here; the
real install runs in `make test-xla`)."""

from infra.pip_stepwise import plan


def _item(name, url, sha=None, direct=False):
    info = {"url": url}
    if sha:
        info["archive_info"] = {"hashes": {"sha256": sha}}
    return {"metadata": {"name": name, "version": "1"}, "download_info": info, "is_direct": direct}


def test_each_download_is_its_own_call_and_local_wheels_go_together():
    items = [
        _item("ddm-fleet", "file:///repo", direct=True),
        _item("torch", "https://files.example/torch-2.9.0.whl", sha="ab12"),
        _item("numpy", "file:///opt/numpy.whl"),
        _item("nvidia-cudnn-cu12", "https://files.example/cudnn.whl"),
        _item("idna", "file:///opt/idna.whl"),
    ]
    calls, direct = plan(items)
    assert calls == [
        ["torch @ https://files.example/torch-2.9.0.whl#sha256=ab12"],
        ["nvidia-cudnn-cu12 @ https://files.example/cudnn.whl"],
        ["numpy @ file:///opt/numpy.whl", "idna @ file:///opt/idna.whl"],
    ]
    assert [d["metadata"]["name"] for d in direct] == ["ddm-fleet"]


def test_nothing_to_install_plans_no_call():
    assert plan([]) == ([], [])
