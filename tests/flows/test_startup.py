"""`flows.startup.probe_mlflow_server`: a tracking server's address is checked with one GET /health before
anything starts, so that nothing answering fails in seconds; any HTTP answer counts."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from flows.failure import ServiceFailed
from flows.startup import probe_mlflow_server
from tests.flows.conftest import free_port


def test_nothing_answering_fails_in_seconds_naming_the_server_without_its_password() -> None:
    uri = f"http://someone:s3cret-7f3a@127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(ServiceFailed) as e:
        probe_mlflow_server(uri)
    assert time.perf_counter() - t0 < 5  # a refused connection, not the client's minute of retries
    assert "127.0.0.1" in e.value.service and "s3cret" not in str(e.value) + " ".join(e.value.hints)
    assert "GET /health" in " ".join(e.value.reason)


class _Answers(http.server.BaseHTTPRequestHandler):
    status = 401  # a basic-auth server without credentials

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("status", [200, 401, 404])
def test_any_http_answer_counts_and_the_path_is_kept(status: int) -> None:
    handler = type("H", (_Answers,), {"status": status, "paths": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        probe_mlflow_server(f"http://u:p@127.0.0.1:{server.server_address[1]}/mlflow/")
    finally:
        server.shutdown()
        server.server_close()
    assert handler.paths == ["/mlflow/health"]


def test_stores_that_are_not_servers_are_not_probed() -> None:
    probe_mlflow_server("sqlite:////nonexistent/dir/mlflow.db")
    probe_mlflow_server("file:///nonexistent")
