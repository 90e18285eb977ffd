"""Random NATS passwords are strings to nats-server: never all digits (it parses an all-digit $VARIABLE as an
integer, "out of the range", and refuses to start: once in a test run, all three start attempts failed)."""

from __future__ import annotations

import re

from infra.nats_cluster import PASSWORD_VARS, NatsCluster, random_password, random_passwords


def test_random_passwords_start_with_a_letter():
    drawn = [random_password() for _ in range(2000)] + list(random_passwords().values())
    assert all(re.fullmatch(r"p[0-9a-f]{24}", pw) for pw in drawn)
    assert len(set(drawn)) == len(drawn)
    assert set(random_passwords()) == set(PASSWORD_VARS)


def test_a_cluster_draws_its_route_password_the_same_way():
    cluster = NatsCluster(1)
    assert re.fullmatch(r"p[0-9a-f]{24}", cluster.route_password)
    assert all(re.fullmatch(r"p[0-9a-f]{24}", pw) for pw in cluster.passwords.values())
