"""`ddm-fleet probe`: every attack on the coordinator is held by a fleet with the shipped defaults."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.bus, pytest.mark.timeout(180)]


def test_every_attack_is_held(capsys):
    from infra.cli import main

    assert main(["probe", "--json"]) == 0
    results = {r["attack"]: r for r in json.loads(capsys.readouterr().out)["attacks"]}
    assert set(results) == {"quota", "status", "cancel", "discovery"}
    assert all(r["held"] for r in results.values()), results
    assert results["quota"]["figures"]["greedy_running_rows"] == 256
    assert results["quota"]["figures"]["greedy_queued_jobs"] == 64
    assert results["status"]["figures"]["results_published"] == 1
    assert results["cancel"]["figures"]["jobs_that_ran"] == []
    assert results["discovery"]["figures"]["messages_on_the_job_subject"] == 0


def test_unknown_attacks_are_refused(capsys):
    from infra.cli import main

    assert main(["probe", "sockets"]) == 2
    assert "unknown attack 'sockets'" in capsys.readouterr().err
