"""$NATS_URL_FILE: a command's bus URL (with its credentials) from a file, neither argv nor env."""

from __future__ import annotations

import pytest

from bus.nats_server import DEFAULT_NATS_URL, ExamplePasswordError, default_nats_url, nats_servers


def test_url_from_a_file(tmp_path):
    f = tmp_path / "nats-url"
    f.write_text("\n  nats://web:s3cr3t-value@nats-1:4222,nats-2:4222  \n")
    assert default_nats_url({"NATS_URL_FILE": str(f)}) == "nats://web:s3cr3t-value@nats-1:4222,nats-2:4222"
    # $NATS_URL wins over the file; neither: the loopback default
    assert default_nats_url({"NATS_URL": "nats://a:b@h:1", "NATS_URL_FILE": str(f)}) == "nats://a:b@h:1"
    assert default_nats_url({}) == DEFAULT_NATS_URL


def test_unreadable_or_empty_file_is_a_clear_exit(tmp_path):
    with pytest.raises(SystemExit, match="cannot read NATS_URL_FILE .*missing"):
        default_nats_url({"NATS_URL_FILE": str(tmp_path / "missing")})
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    with pytest.raises(SystemExit, match="holds no URL"):
        default_nats_url({"NATS_URL_FILE": str(empty)})


def test_example_password_in_the_file_is_refused(tmp_path):
    f = tmp_path / "nats-url"
    f.write_text("nats://worker-0:change-me@nats-1:4222\n")
    with pytest.raises(ExamplePasswordError, match="example password 'change-me'"):
        nats_servers(default_nats_url({"NATS_URL_FILE": str(f)}))
