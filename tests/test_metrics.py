"""The service's OpenMetrics endpoint, scraped over real HTTP from a real service and read
with prometheus-client's own parser; its values against the index."""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.request

import pytest
from conftest import wait_for
from rawclient import closed_by_server
from test_telegram_bot import ME, api, setup  # noqa: F401  (api is a fixture)

pytest.importorskip("prometheus_client", reason="the `metrics` extra (prometheus-client) is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kugetsu.frontends import metrics  # noqa: E402


def endpoint(kg) -> str:
    """The endpoint's URL, as the service logged it (port 0 in the config: any free port)."""
    line = wait_for(lambda: re.search(r"metrics on (http://\S+/metrics)", kg.home.service_log.read_text()), 15,
                    "the service to say where its metrics are")
    return line.group(1)  # type: ignore[union-attr]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the page: (name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def matches_index(samples: dict, index: dict, groups: dict) -> bool:
    running, queued = index["active"], index["queued"]
    want = {
        ("kugetsu_tasks_running", ()): len(running),
        ("kugetsu_tasks_queued", ()): len(queued),
        ("kugetsu_slots_free", ()): max(0, 2 - len(running)),
        ("kugetsu_max_agents", ()): 2,
    }
    for name, g in groups.items():
        labels = (("group", name),)
        want[("kugetsu_group_max_agents", labels)] = g["max_agents"]
        want[("kugetsu_group_tasks_running", labels)] = sum(1 for t in running if t.get("group") == name)
        want[("kugetsu_group_tasks_queued", labels)] = sum(1 for t in queued if t.get("group") == name)
    return all(samples.get(k) == v for k, v in want.items())


def test_scraped_values_follow_the_index(kg):
    groups = {"gpu": {"max_agents": 1}}
    kg.config(max_agents=2, groups=groups, metrics={"listen": "127.0.0.1:0"})
    kg.ok("serve", "--detach")  # counters count from the service's start
    url = endpoint(kg)
    kg.delegate("ok", 0)
    kg.delegate("bad", 0, 4)
    kg.wait_state("ok", "succeeded")
    kg.wait_state("bad", "failed")
    gate = kg.rec / "go"
    kg.delegate("a", 0, 0, "--group", "gpu", gate=gate)
    kg.delegate("b", 0, 0, gate=gate)
    kg.delegate("c", 0, 0, gate=gate)  # queued: both slots are taken
    kg.delegate("d", 0, 0, "--group", "gpu", gate=gate)  # queued
    kg.delegate("e", 0, 0, gate=gate)  # queued, then cancelled
    kg.ok("cancel", "e")

    samples = wait_for(lambda: (s := scrape(url)) and matches_index(s, kg.index(), groups) and s, 15,
                       "the page to show the queue")
    index = kg.index()
    assert len(index["active"]) == 2 and len(index["queued"]) == 2  # what the page was compared with
    assert value(samples, "kugetsu_group_tasks_running", group="gpu") == 1
    assert value(samples, "kugetsu_group_tasks_queued", group="gpu") == 1
    assert value(samples, "kugetsu_tasks_finished_total", state="succeeded") == 1
    assert value(samples, "kugetsu_tasks_finished_total", state="failed") == 1
    assert value(samples, "kugetsu_tasks_finished_total", state="cancelled") == 1
    assert value(samples, "kugetsu_tasks_finished_total", state="expired") == 0
    assert value(samples, "kugetsu_tasks_admitted_total") == 7
    assert value(samples, "kugetsu_tasks_started_total") == 4  # ok, bad, a, b
    assert value(samples, "kugetsu_task_wait_seconds_count") == 4
    assert value(samples, "kugetsu_task_run_seconds_count") == 2  # ok and bad ran; e never did
    started = value(samples, "kugetsu_service_start_time_seconds")
    assert started is not None and abs(started - __import__("time").time()) < 120

    gate.touch()  # a and b end; c and d take their slots: promotions
    for name in "abcd":
        kg.wait_state(name, "succeeded")
    samples = wait_for(lambda: (s := scrape(url)) and value(s, "kugetsu_tasks_finished_total", state="succeeded") == 5
                       and s, 15, "the page to count every end")
    assert matches_index(samples, kg.index(), groups)
    assert value(samples, "kugetsu_tasks_started_total") == 6
    assert value(samples, "kugetsu_task_run_seconds_count") == 6
    # Every start of c and d came after a's or b's exit; it is measured in milliseconds.
    promotions = value(samples, "kugetsu_promotion_latency_seconds_count")
    assert promotions == 2
    assert 0 <= value(samples, "kugetsu_promotion_latency_seconds_sum") < 5  # type: ignore[operator]
    # The bucket counts are cumulative and end at the count.
    assert value(samples, "kugetsu_promotion_latency_seconds_bucket", le="+Inf") == promotions


def test_metrics_are_off_by_default_and_a_busy_port_stops_only_them(kg):
    kg.config()
    kg.delegate("plain", 0)
    kg.wait_state("plain", "succeeded")
    kg.ok("shutdown")
    assert "metrics on" not in kg.home.service_log.read_text()

    with socket.socket() as taken:  # someone else has the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        kg.config(metrics={"listen": f"127.0.0.1:{port}"})
        kg.delegate("still-runs", 0)
        kg.wait_state("still-runs", "succeeded")
        wait_for(lambda: "metrics endpoint could not start" in kg.home.service_log.read_text(), 10, "the log line")


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_connections_do_not_each_take_a_thread(kg):
    """Any local user can open connections to the endpoint; each used to cost the service a
    thread for as long as it stayed open (681 threads in 100 s)."""
    kg.config(metrics={"listen": "127.0.0.1:0"})
    kg.ok("serve", "--detach")
    url = endpoint(kg)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    pid = kg.service_pid()
    assert pid is not None and scrape(url)
    before = threads(pid)
    # The loop's default executor may add its threads (at most min(32, cores + 4)) meanwhile,
    # as the service reads /proc off the loop: they come and stay, whatever the connections.
    pool = min(32, (os.cpu_count() or 1) + 4)
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    try:
        # Those past the bound are closed at once; the rest are closed by the request timeout.
        wait_for(lambda: sum(map(closed_by_server, socks)) >= 200 - metrics.MAX_CONNECTIONS, 20,
                 f"the connections past the bound to be closed (service threads: {threads(pid)})")
        assert threads(pid) <= before + metrics.MAX_CONNECTIONS + pool
        wait_for(lambda: all(map(closed_by_server, socks)), metrics.REQUEST_TIMEOUT + 10,
                 "the idle connections to time out")
    finally:
        for s in socks:
            s.close()
    assert scrape(url)  # still serving
    wait_for(lambda: threads(pid) <= before + pool, 10, "the service's threads to go back to what they were")


def test_a_slow_request_is_dropped_after_the_timeout(kg):
    """Slowloris: a request whose headers come a byte at a time never ends by itself."""
    kg.config(metrics={"listen": "127.0.0.1:0"})
    kg.ok("serve", "--detach")
    url = endpoint(kg)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        deadline = started + metrics.REQUEST_TIMEOUT + 10
        while not closed_by_server(s):
            assert time.monotonic() < deadline, "the slow request was never dropped"
            try:
                s.sendall(b"X")  # one more byte of a header, every tenth of a second
            except OSError:
                break
            time.sleep(0.1)
        assert time.monotonic() - started < metrics.REQUEST_TIMEOUT + 5
    assert scrape(url)


@pytest.mark.parametrize("address, message", [
    ("0.0.0.0:9464", "not a loopback address"),
    ("[::]:9464", "not a loopback address"),
    ("example.org:9464", "not a loopback address"),
    ("127.0.0.1", "is not HOST:PORT"),
    ("127.0.0.1:99999", "is not HOST:PORT"),
])
def test_a_bind_beyond_this_machine_must_be_asked_for(kg, address, message):
    kg.config(autostart=False)
    before = kg.home.config.read_bytes()
    r = kg.run("config", "set", "metrics.listen", address)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert kg.home.config.read_bytes() == before
    if "loopback" in message:
        assert "metrics.allow_remote" in r.stderr  # the message says how to ask for it
        kg.ok("config", "set", "metrics.allow_remote", "true")
        kg.ok("config", "set", "metrics.listen", address)
        assert json.loads(kg.home.config.read_text())["metrics"] == {"allow_remote": True, "listen": address}


def test_telegram_delivery_lag_per_chat(kg, api):
    setup(kg, api, metrics={"listen": "127.0.0.1:0"})
    kg.ok("serve", "--detach")
    url = endpoint(kg)
    api.fail(500, methods={"sendMessage"})  # Telegram is down: events pile up for the chat
    kg.delegate("news", 0)
    kg.wait_state("news", "succeeded")
    wait_for(lambda: (value(scrape(url), "kugetsu_telegram_undelivered_events", chat=str(ME)) or 0) >= 2, 15,
             "the page to show undelivered events")
    api.recover()
    wait_for(lambda: value(scrape(url), "kugetsu_telegram_undelivered_events", chat=str(ME)) == 0, 30,
             "the lag to go back to 0 once delivered")
