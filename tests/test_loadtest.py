"""``blockspec loadtest`` against a running test server, and its refusal of other hosts."""

import json

import pytest

from blockspec.cli import main
from blockspec.errors import BlockspecError
from blockspec.serve.app import create_app
from blockspec.serve.loadtest import check_loopback, percentile, run_loadtest
from helpers import load_served_target, running_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server_url(tiny_target_dir):
    app = create_app(load_served_target(tiny_target_dir), None, max_batch_size=4, max_queue=16)
    with running_server(app) as url:
        yield url


def test_loadtest_reports_sane_numbers(server_url):
    report = run_loadtest(server_url, concurrency=4, requests=8, max_tokens=8, prompt="Count to ten.", timeout=60)
    assert (report.completed, report.errors, report.timed_out) == (8, 0, False)
    assert 8 <= report.output_tokens <= 8 * 8
    assert report.output_tokens_per_s > 0 and report.requests_per_s > 0
    assert 0 < report.ttft_p50_ms <= report.ttft_p99_ms < report.duration_s * 1000
    assert 0 < report.itl_p50_ms <= report.itl_p99_ms
    assert "inter-token latency p99" in report.table()


def test_loadtest_command_prints_json(server_url, capsys):
    code = main(["loadtest", "--url", server_url, "--concurrency", "2", "--requests", "2", "--max-tokens", "4",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["completed"] == 2 and report["errors"] == 0
    code = main(["loadtest", "--url", server_url, "--concurrency", "3", "--requests", "3", "--max-tokens", "4",
                 "--dataset", "gsm8k", "--temperature", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["completed"] == 3 and report["errors"] == 0


def test_loadtest_counts_refused_requests_as_errors(server_url):
    report = run_loadtest(server_url, concurrency=1, requests=2, max_tokens=4, model="not-served", timeout=30)
    assert (report.completed, report.errors) == (0, 2)
    assert "404" in report.error_messages[0]


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.5:8000", "http://0.0.0.0:8000",
                                 "ftp://127.0.0.1:8000", "http://127.0.0.1.evil.com"])
def test_loadtest_refuses_anything_but_loopback(url, capsys):
    with pytest.raises(BlockspecError, match="loadtest only targets this machine|http"):
        check_loopback(url)
    assert main(["loadtest", "--url", url, "--requests", "1"]) == 2
    assert "blockspec: error:" in capsys.readouterr().err


def test_loopback_urls_are_accepted():
    for url in ["http://127.0.0.1:8000/", "http://localhost:9", "http://[::1]:8000"]:
        assert check_loopback(url) == url.rstrip("/")


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
