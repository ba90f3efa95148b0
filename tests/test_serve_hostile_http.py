"""`npuport serve` against clients that mean harm, over real sockets: a chat template sent by a request (refused
unless the operator allows it) and template variables that could blow up the rendered prompt, connections that
send nothing or a byte at a time (they hold no slot a real request needs), the address to listen on (a port in use,
IPv6 loopback), and the prompt limit."""

from __future__ import annotations

import errno
import http.client
import json
import select
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.runtime.serving.api_requests import RequestError, parse_completion_request
from npuport.runtime.serving.limits import ServeLimits
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from tests.test_serve import KIND, call, post, running, serve_process
from tests.test_serve_limits import PROMPT, address, closed_by_server, exchange, openai_error

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KEY = "k-7d1e05"
AUTHORIZED = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]
OWN_TEXT = "Question: 2 + 2 =\nAnswer:"
OWN_TEMPLATE = "{{ '" + OWN_TEXT.replace("\n", "\\n") + "' }}"  # renders OWN_TEXT whatever the messages
EOS_AFTER_EACH_MESSAGE = "{%- for message in messages %}{{ message['content'] + eos_token }}{%- endfor %}"


@pytest.fixture(scope="module")
def runner(tiny_artifacts) -> RuntimeCompletions:
    return RuntimeCompletions.load(tiny_artifacts[KIND], device="cpu", batch_size=4)


def post_chat(url: str, payload: dict) -> tuple[int, dict]:
    return call(url + "/v1/chat/completions", json.dumps(payload).encode())


# -- a chat template sent by a request -------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "field"), [
    ({"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}, "chat_template_kwargs.chat_template"),
    ({"chat_template": OWN_TEMPLATE}, "chat_template"),
], ids=["in-chat_template_kwargs", "top-level"])
def test_a_chat_template_sent_by_a_request_is_refused_naming_the_field(runner, extra, field):
    with running(make_server(runner, "tiny")) as url:
        status, answer = post_chat(url, {"messages": MESSAGES, "max_tokens": 2, **extra})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == field and error["message"].startswith(f"'{field}'")
    assert "--allow-client-chat-template" in error["message"] and "chat_template.jinja" not in error["message"]


def test_an_allowed_request_template_is_rendered_and_its_failure_names_the_field_not_the_models_file(runner):
    with running(make_server(runner, "tiny", limits=ServeLimits(allow_client_chat_template=True))) as url:
        rendered, answer = post_chat(url, {"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                           "chat_template_kwargs": {"chat_template": OWN_TEMPLATE}})
        broken, error = post_chat(url, {"messages": MESSAGES, "max_tokens": 2, "chat_template": "{% for %}"})
    assert rendered == 200 and answer["usage"]["prompt_tokens"] == len(runner.encode(OWN_TEXT))
    assert broken == 400 and error["error"]["param"] == "chat_template"
    message = error["error"]["message"]
    assert message.startswith("'chat_template'") and "TemplateSyntaxError" in message
    assert "chat_template.jinja" not in message


@pytest.fixture(scope="module")
def eos_runner(tiny_artifacts, tmp_path_factory) -> RuntimeCompletions:
    """The tiny model with a template that writes eos_token after every message, as many templates do: a request
    that sets eos_token has it written once per message."""
    model = shutil.copytree(tiny_artifacts[KIND], tmp_path_factory.mktemp("eos") / "model")
    (model / "chat_template.jinja").write_text(EOS_AFTER_EACH_MESSAGE, encoding="utf-8")
    return RuntimeCompletions.load(model, device="cpu", batch_size=1)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"eos_token": "x" * 100_000}, "chat_template_kwargs"),  # x 256 messages: 25.6 MB rendered
    ({"tokenize": True}, "chat_template_kwargs.tokenize"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": []}, "chat_template_kwargs.messages"),
], ids=["100-kB-value", "tokenize", "add_generation_prompt", "messages"])
def test_chat_template_kwargs_are_bounded_and_cannot_set_the_renderers_own_arguments(eos_runner, kwargs, param):
    many = [{"role": "user", "content": "hi"}] * 256
    with running(make_server(eos_runner, "tiny")) as url:
        status, answer = post_chat(url, {"messages": many, "max_tokens": 1, "chat_template_kwargs": kwargs})
        plain, _ = post_chat(url, {"messages": many[:2], "max_tokens": 1,
                                   "chat_template_kwargs": {"enable_thinking": False, "eos_token": "<|im_end|>"}})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["message"].startswith(f"'{param}'")
    assert "chat_template.jinja" not in error["message"]
    assert plain == 200


# -- connections that send nothing, or a byte at a time --------------------------------------------------------


def drip(sockets: list[socket.socket], stop: threading.Event) -> None:
    """A byte a second on each socket, as a client that keeps its request arriving for ever, until stopped."""
    while not stop.wait(1.0):
        for sock in sockets:
            try:
                sock.sendall(b"X")
            except OSError:
                pass


def test_idle_and_dripping_connections_leave_room_for_an_authenticated_request(runner):
    """32 connections that send nothing and 32 that send their headers a byte a second, then a real request with
    the key: it is answered while all 64 are still connected and unanswered."""
    # the crowd stays for the whole test, however slow the machine; it shares the request's address, whose limit
    # of open connections would otherwise have the request take the place of the oldest idle one
    limits = ServeLimits(header_timeout_s=60.0, max_client_connections=128)
    with running(make_server(runner, "tiny", limits=limits, api_key=KEY)) as url:
        idle = [socket.create_connection(address(url), timeout=10) for _ in range(32)]
        dripping = [socket.create_connection(address(url), timeout=10) for _ in range(32)]
        stop = threading.Event()
        dripper = threading.Thread(target=drip, args=(dripping, stop), daemon=True)
        try:
            for sock in dripping:
                sock.sendall(b"POST /v1/completions HTTP/1.0\r\nX-Slow: ")
            dripper.start()
            status, _, raw = exchange(url, "POST", "/v1/completions",
                                      json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode(), AUTHORIZED)
            answered_or_dropped = select.select(idle + dripping, [], [], 0)[0]
        finally:
            stop.set()
            for sock in idle + dripping:
                sock.close()
    assert status == 200, raw[:300]
    assert json.loads(raw)["object"] == "text_completion"
    assert answered_or_dropped == []


def test_a_request_whose_body_is_still_arriving_holds_no_serving_slot(runner):
    limits = ServeLimits(max_connections=1, request_timeout_s=60.0)
    with running(make_server(runner, "tiny", limits=limits, api_key=KEY)) as url:
        with socket.create_connection(address(url), timeout=10) as slow:
            slow.sendall(f"POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer {KEY}\r\n"
                         "Content-Length: 1000\r\n\r\n{".encode())
            status, _, raw = exchange(url, "POST", "/v1/completions",
                                      json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode(), AUTHORIZED)
            slow_waiting = select.select([slow], [], [], 0)[0] == []
    assert status == 200, raw[:300]
    assert slow_waiting


def second_request_while_the_first_generates(runner, limits: ServeLimits, batch_size: int = 1):
    """(status, headers, body of a second completion request sent while the first is generating, the first's
    status): the model holds its batch until the second is answered."""
    generating, go_on = threading.Event(), threading.Event()

    class Held(RuntimeCompletions):
        """The loaded model, holding each prefill until the test lets it go on."""

        def prefill_slots(self, *args, **kwargs):
            generating.set()
            go_on.wait(60)
            return super().prefill_slots(*args, **kwargs)

    held = Held(runner.model, runner.tokenizer, batch_size=batch_size, context_tokens=runner.context_tokens)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    with running(make_server(held, "tiny", limits=limits)) as url:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(exchange, url, "POST", "/v1/completions", body)
            try:
                assert generating.wait(60)
                status, headers, raw = exchange(url, "POST", "/v1/completions", body)
            finally:
                go_on.set()
            return status, headers, raw, first.result()[0]


def test_requests_beyond_max_connections_get_503_while_the_others_are_served(runner):
    """max_connections still bounds the requests being served: with one slot, a second request while the first
    is generating is answered 503 at once, and the first is answered in full."""
    status, headers, raw, first_status = second_request_while_the_first_generates(
        runner, ServeLimits(max_connections=1))
    assert status == 503 and headers.get("Retry-After") == "1"
    assert openai_error(raw)["code"] == "server_busy"
    assert first_status == 200


def test_headers_beyond_the_size_a_client_may_send_get_431(runner):
    """90 header lines of 1 kB each: every line within http.server's own limits, all of them beyond the head's."""
    head = b"GET /health HTTP/1.0\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(90))
    with running(make_server(runner, "tiny")) as url, socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(head + b"\r\n")
        raw = b""
        try:
            while chunk := sock.recv(65536):
                raw += chunk
        except ConnectionResetError:  # closed with the rest of the headers unread: its answer came first
            pass
    status_line, _, body = raw.partition(b"\r\n\r\n")
    assert int(status_line.split()[1]) == 431, raw[:300]
    assert "bytes" in openai_error(body)["message"]


# -- the address to listen on ------------------------------------------------------------------------------------


def test_serve_on_a_port_in_use_prints_one_line_naming_the_address(tiny_artifacts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", str(tiny_artifacts[KIND]), "--port", str(port), "--device", "cpu",
                                           "--quiet"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.output.splitlines()
    assert "Traceback" not in result.output


def ipv6_loopback_missing() -> str | None:
    """Why this machine cannot listen on [::1]; None when it can."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as e:
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return f"binding ::1 fails ({e.strerror})"
        raise
    return None


def test_serve_on_ipv6_loopback_answers_there(tiny_artifacts):
    missing = ipv6_loopback_missing()
    if missing is not None:  # what can still be checked: one line, no traceback
        result = CliRunner().invoke(main, ["serve", str(tiny_artifacts[KIND]), "--host", "::1", "--port", "0",
                                           "--device", "cpu", "--quiet"])
        assert result.exit_code == 1 and "error: cannot listen on [::1]:0: " in result.output, result.output
        pytest.skip(f"no connection to [::1] on this machine: {missing}")
    with serve_process(tiny_artifacts[KIND], "--host", "::1") as url:
        assert url.startswith("http://[::1]:"), url
        with closing(http.client.HTTPConnection("::1", int(url.rsplit(":", 1)[1]), timeout=30)) as connection:
            connection.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            status, answer = response.status, json.loads(response.read())
    assert status == 200 and answer["object"] == "text_completion"


# -- the prompt limit --------------------------------------------------------------------------------------------


def test_token_id_prompts_over_the_limit_are_refused_as_the_body_is_read():
    body = {"prompt": [[5] * 8, [5] * 9]}
    assert len(parse_completion_request(body, "tiny", 16, max_prompt_tokens=9).prompts) == 2
    with pytest.raises(RequestError) as refused:
        parse_completion_request(body, "tiny", 16, max_prompt_tokens=8)
    assert refused.value.param == "prompt" and refused.value.status == 400
    assert "prompt 1 has 9 tokens" in str(refused.value) and "8" in str(refused.value)


def test_prompts_over_the_limit_are_refused_token_ids_before_anything_else_text_once_tokenized(runner):
    ids = runner.encode(PROMPT)
    limit = len(ids)
    with running(make_server(runner, "tiny", limits=ServeLimits(max_prompt_tokens=limit))) as url:
        fits = post(url, {"prompt": PROMPT, "max_tokens": 1})
        ids_over = post(url, {"prompt": [999_999] * (limit + 1), "max_tokens": 1})  # not even in the vocabulary
        text_over = post(url, {"prompt": PROMPT + PROMPT, "max_tokens": 1})
        chat_over = post_chat(url, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1})
    assert fits[0] == 200
    for (status, answer), param in ((ids_over, "prompt"), (text_over, "prompt"), (chat_over, "messages")):
        assert status == 400, answer
        error = answer["error"]
        assert error["param"] == param and error["code"] == "prompt_too_long"
        assert f"at most {limit}" in error["message"] and "--max-prompt-tokens" in error["message"]


# -- the command line ------------------------------------------------------------------------------------------


def test_the_serve_commands_defaults_are_the_serve_limits_defaults():
    """The command line names its defaults without importing the server (which imports torch): they must agree."""
    options = {p.name: p.default for p in main.commands["serve"].params}
    limits = ServeLimits()
    assert (options["max_tokens_limit"], options["max_prompt_tokens"], options["header_timeout_s"],
            options["request_timeout_s"], options["max_connections"], options["max_pending_connections"],
            options["allow_client_chat_template"], options["max_client_connections"],
            options["max_client_requests"]) == (
        limits.max_tokens, limits.max_prompt_tokens, limits.header_timeout_s, limits.request_timeout_s,
        limits.max_connections, limits.max_pending_connections, limits.allow_client_chat_template,
        limits.max_client_connections, limits.max_client_requests)


def test_serve_options_reach_the_server(tiny_artifacts):
    with serve_process(tiny_artifacts[KIND], "--max-prompt-tokens", "4", "--allow-client-chat-template",
                       "--header-timeout", "1") as url:
        over = post(url, {"prompt": [5] * 5, "max_tokens": 1})
        own = post_chat(url, {"messages": MESSAGES, "max_tokens": 1, "chat_template": "{{ 'Answer:' }}"})
        with socket.create_connection(address(url), timeout=10) as idle:
            closed_after = closed_by_server(idle, within_s=8)
    assert over[0] == 400 and "at most 4" in over[1]["error"]["message"]
    assert own[0] == 200
    assert closed_after is not None and closed_after < 4

