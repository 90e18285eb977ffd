"""Unconditional images (digit -1, label unknown) from the viewer: the page's "?" digit and its
"unconditional (no digit)" choice, the oracle refusal in web/protocol.py, then real headless Chromium
against real fleets: tiny experts with a null label serve such a job to the end; the shipped fleet
(experts without one) refuses it, and the page says so instead of waiting. Screenshots go to
out/screenshots/unconditional*.png.
"""

from __future__ import annotations

import json

import pytest

from schemas import UNCONDITIONAL
from tests.web.test_app_browser import open_page, web_server  # noqa: F401 (fixtures)
from tests.web.test_app_trajectories import _shot
from web.protocol import BadInput, Generate, parse_client_message, parse_digits

U = UNCONDITIONAL


# ---------------------------------------------------------------- protocol units


@pytest.mark.parametrize(
    "value, digits", [("?", [U]), ("-1", [U]), ("?,3 -1;?", [U, 3, U, U]), ([U, 0, 9], [U, 0, 9]), ("3,7", [3, 7])]
)
def test_parse_digits_takes_question_mark_and_minus_one_as_no_digit(value, digits):
    assert parse_digits(value) == digits


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("-2", "'-2' is not a digit"),
        ("??", "'??' is not a digit"),
        ("?1", "'?1' is not a digit"),
        ([-2], "got -2 (or -1: no digit)"),
        ([U, True], "integers 0-9"),
        ([10], "integers 0-9"),
    ],
)
def test_parse_digits_still_refuses_other_values(value, fragment):
    with pytest.raises(BadInput) as err:
        parse_digits(value)
    assert fragment in err.value.message


@pytest.mark.parametrize("strategy", ["top1", "topk", "full"])
def test_generate_with_no_digit_rows_builds_a_job_request(strategy):
    cmd = parse_client_message(json.dumps({"type": "generate", "digits": "?,4,?", "strategy": strategy, "ref": 3}))
    assert isinstance(cmd, Generate) and cmd.ref == 3
    assert cmd.request.digits == [U, 4, U] and cmd.request.n_unconditional == 2
    listed = parse_client_message(json.dumps({"type": "generate", "digits": [U] * 5, "strategy": strategy}))
    assert listed.request.digits == [U] * 5


@pytest.mark.parametrize("digits", ["?", "3,-1", [1, 2, U]])
def test_oracle_with_a_no_digit_row_is_refused_with_a_reason(digits):
    with pytest.raises(BadInput) as err:
        parse_client_message(json.dumps({"type": "generate", "digits": digits, "strategy": "oracle", "ref": "r9"}))
    msg = err.value.message
    assert err.value.code == "bad_request" and err.value.ref == "r9"
    assert "oracle" in msg and "no digit" in msg and "top-1, top-k or full ensemble" in msg, msg
    n = len(parse_digits(digits))
    assert f"1 of {n} images has no digit" in msg, msg


def test_oracle_with_every_digit_known_is_still_taken():
    assert parse_client_message(
        json.dumps({"type": "generate", "digits": "3,7", "strategy": "oracle"})
    ).request.digits == [3, 7]
    assert parse_client_message(json.dumps({"type": "generate", "count": 4, "strategy": "oracle"})).request.count == 4


def test_no_digit_rows_keep_the_job_limits():
    with pytest.raises(BadInput) as err:
        parse_client_message(json.dumps({"type": "generate", "digits": [U] * 300}))
    assert "300 images requested; the limit is 256" in err.value.message
    with pytest.raises(BadInput) as err:
        parse_client_message(json.dumps({"type": "generate", "digits": "?", "count": 2}))
    assert "give exactly one of labels" in err.value.message


# ---------------------------------------------------------------- in Chromium, real fleets


@pytest.fixture(scope="module")
def null_label_files(tmp_path_factory):
    """Two tiny experts with a null label (as `train-expert --label-dropout > 0`, classes 0-4 | 5-9) and a
    tiny router: ``(expert paths, router path)``."""
    from models.tiny import make_tiny_experts, make_tiny_router

    d = tmp_path_factory.mktemp("web-null-fleet")
    return make_tiny_experts(d, 2, widths=(8, 16, 32), null_label=True), make_tiny_router(d / "router", 2)


@pytest.fixture
async def null_label_fleet(nats_url, null_label_files):
    """Real torch workers (null-label experts), a real coordinator and router on the session's nats-server."""
    import torch

    from coordinator.local_fleet import LocalFleet
    from models.router import Router

    experts, router = null_label_files
    fleet = LocalFleet(
        experts,
        Router.load(router),
        num_experts=2,
        class_to_expert=[0] * 5 + [1] * 5,
        nats_url=nats_url,
        buckets=(1, 2, 4, 8),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared small box: one intra-op thread keeps tiny forwards fast
    try:
        async with fleet:
            yield fleet
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
async def fleet_without_null_label(nats_url, tiny_fleet_files):
    """Real torch workers whose tiny experts have no null label (tests/web/conftest.py), a real coordinator."""
    import torch

    from coordinator.local_fleet import LocalFleet
    from models.router import Router

    fleet = LocalFleet(
        tiny_fleet_files["experts"],
        Router.load(tiny_fleet_files["router"]),
        num_experts=2,
        class_to_expert=[0] * 5 + [1] * 5,
        nats_url=nats_url,
        buckets=(1, 2, 4, 8),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with fleet:
            yield fleet
    finally:
        torch.set_num_threads(threads)


async def _labels(job) -> list[str]:
    return await job.locator(".tile .label span").evaluate_all("ss => ss.map(s => s.textContent)")


@pytest.mark.slow  # ~5 s: two jobs on a real tiny fleet driven from Chromium
async def test_unconditional_job_completes_with_question_marks_on_its_tiles(browser, web_server, null_label_fleet):
    page, errors = await open_page(browser, web_server)
    await page.wait_for_function(
        "() => document.querySelectorAll('#fleet-experts .expert').length >= 2", timeout=60_000
    )
    # the "unconditional (no digit)" choice with a count: three images, every label unknown
    await page.check("input[name=mode][value=count]")
    await page.fill("#count", "3")
    await page.check("#unconditional")
    await page.fill("#steps", "6")
    await page.fill("#seed", "77")
    await page.select_option("#strategy", "top1")
    await page.click("#generate")
    job = page.locator(".job[data-state=done]").first
    await job.wait_for(timeout=120_000)
    assert "3 images · unconditional · seed 77" in await job.locator(".job-title").inner_text()  # from `accepted`
    assert await _labels(job) == ["digit ?"] * 3
    canvases = job.locator(".tile canvas")
    assert await canvases.evaluate_all("cs => cs.every(c => c.dataset.final === '1')")
    assert set(await canvases.evaluate_all("cs => cs.map(c => c.dataset.expert)")) <= {
        "0",
        "1",
    }  # top-1: the router's pick
    assert (
        await job.locator(".tile a.download").first.get_attribute("download")
        == f"ddm-{await job.get_attribute('data-job-id')}-0-nodigit.png"
    )
    await job.locator("canvas.served").hover(position={"x": 2, "y": 1})
    assert "image 0 (digit ?)" in await page.locator("#tip").inner_text()

    # "?" typed among digits: a mixed job (full ensemble), only the "?" row without a digit
    await page.uncheck("#unconditional")
    await page.check("input[name=mode][value=digits]")
    await page.fill("#digits", "?,4")
    await page.select_option("#strategy", "full")
    await page.click("#generate")
    await page.wait_for_function(
        "() => document.querySelectorAll('.job[data-state=done]').length >= 2", timeout=120_000
    )
    mixed = page.locator(".job").first  # new jobs go on top
    assert await _labels(mixed) == ["digit ?", "digit 4"]
    assert "2 images · 1 unconditional" in await mixed.locator(".job-title").inner_text()
    assert await page.locator("#errors li").count() == 0
    await _shot(page, "unconditional.png", full_page=True)
    assert errors == [], errors
    await page.close()


@pytest.mark.slow  # ~5 s: tiny experts without a null label driven from Chromium
async def test_refusals_of_unconditional_jobs_are_shown_on_the_page(browser, web_server, fleet_without_null_label):
    """The experts have no null label (the shipped ones have one since they were retrained): the
    coordinator refuses an unconditional job; oracle with one is refused by the web server itself."""
    page, errors = await open_page(browser, web_server)
    await page.wait_for_function(
        "() => document.querySelectorAll('#fleet-experts .expert').length >= 2", timeout=60_000
    )
    first_error = page.locator("#errors li").first
    # oracle needs every digit: refused by web/protocol.py, said on the page
    await page.check("input[name=mode][value=count]")
    await page.fill("#count", "2")
    await page.check("#unconditional")
    await page.fill("#steps", "3")
    await page.select_option("#strategy", "oracle")
    await page.click("#generate")
    await first_error.wait_for(timeout=20_000)
    text = await first_error.inner_text()
    assert "oracle" in text and "2 of 2 images have no digit" in text and "top-1" in text, text

    # top-1: the web server takes it, the coordinator refuses it (no null label); the page shows why
    await page.select_option("#strategy", "top1")
    await page.click("#generate")
    await page.wait_for_function(
        "() => document.querySelector('#errors li').textContent.includes('rejected')", timeout=30_000
    )
    text = await first_error.inner_text()
    assert "job rejected (bad_request)" in text and "null label" in text and "label-dropout" in text, text
    assert await page.locator(".job").count() == 0  # nothing left waiting: no card was ever accepted
    assert await page.is_enabled("#generate")
    await _shot(page, "unconditional-refused.png")

    # the page and the fleet keep working: the same form without the choice makes a job
    await page.uncheck("#unconditional")
    await page.fill("#count", "1")
    await page.click("#generate")
    done = page.locator(".job[data-state=done]")
    await done.wait_for(timeout=120_000)
    assert "?" not in "".join(await _labels(done))
    assert errors == [], errors
    await page.close()
